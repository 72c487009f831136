"""GTrXL gates (Parisotto et al. 2019, eq. 1-8) against the GRU gate written out with the weight matrices."""

from __future__ import annotations

import torch

from tests.models.blocks.conftest import assert_matches_by_hand, tiny_model
from xscale.models.blocks.gtrxl import GATE_BIAS


def _gate_by_hand(gate, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = torch.sigmoid(y @ gate.w_r.weight.T + x @ gate.u_r.weight.T)
    z = torch.sigmoid(y @ gate.w_z.weight.T + x @ gate.u_z.weight.T - gate.gate_bias)
    h = torch.tanh(y @ gate.w_g.weight.T + (r * x) @ gate.u_g.weight.T)
    return (1 - z) * x + z * h


def _block_by_hand(block, position, x: torch.Tensor) -> torch.Tensor:
    attention, ffn = block.attention, block.feed_forward
    x = _gate_by_hand(attention.gate, x, torch.relu(attention.sublayer(attention.norm(x), position)))
    return _gate_by_hand(ffn.gate, x, torch.relu(ffn.sublayer(ffn.norm(x))))


def test_gated_block_matches_the_gru_gates_by_hand_outputs_and_gradients() -> None:
    model = tiny_model("gtrxl")
    block, position = model.stack.layers["0"], model.stack.position
    grads = assert_matches_by_hand(block, lambda x: block(x, position), lambda x: _block_by_hand(block, position, x),
                                   torch.randn(2, 8, 16))
    assert float(grads["attention.gate.gate_bias"].abs().sum()) > 0


def test_gate_bias_starts_at_two_so_blocks_start_near_the_identity() -> None:
    model = tiny_model("gtrxl")
    biases = [p for name, p in model.named_parameters() if name.endswith("gate_bias")]
    assert len(biases) == 4 and all(torch.equal(b, torch.full_like(b, GATE_BIAS)) for b in biases)
    gate, x = model.stack.layers["0"].attention.gate, torch.randn(2, 8, 16)
    update = torch.sigmoid(gate.w_z(torch.zeros_like(x)) + gate.u_z(x) - gate.gate_bias)
    assert float(update.detach().mean()) < 0.2  # sigmoid(-2) = 0.12: most of x passes through


def test_each_gate_saves_the_activations_the_estimator_counts() -> None:
    """The gate's declared extra activations (bytes per token and feature at 16 bits) are what autograd keeps: every
    saved tensor that is neither a parameter nor one of the residual's inputs (the stream x, the sub-layer's output)."""
    model = tiny_model("gtrxl")
    block = model.stack.layers["0"]
    gate = block.attention.gate
    x = torch.randn(2, 8, 16, requires_grad=True)
    branch = torch.randn(2, 8, 16, requires_grad=True)
    parameters = {parameter.data_ptr() for parameter in gate.parameters()}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters | {x.data_ptr(), branch.data_ptr()}:
            saved[tensor.data_ptr()] = tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        gate(x, torch.relu(branch))
    tensors = sum(saved.values()) / x.numel()
    assert tensors == 6 and 2 * tensors == type(block).extra_activations_per_residual
