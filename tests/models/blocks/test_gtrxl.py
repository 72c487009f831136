"""GTrXL gates (Parisotto et al. 2019, eq. 1-8) against the GRU gate written out with the weight matrices."""

from __future__ import annotations

import torch

from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.models.blocks.gtrxl import GATE_BIAS

GTRXL = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, block="gtrxl")


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
    model = build_model(GTRXL, seed=0)
    block, position = model.stack.layers["0"], model.stack.position
    x = torch.randn(2, 8, 16, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_(True)
    out = block(x, position)
    torch.testing.assert_close(out, _block_by_hand(block, position, x))
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    _block_by_hand(block, position, reference_x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad)
    for name, p in block.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert float(grads["attention.gate.gate_bias"].abs().sum()) > 0


def test_gate_bias_starts_at_two_so_blocks_start_near_the_identity() -> None:
    model = build_model(GTRXL, seed=0)
    biases = [p for name, p in model.named_parameters() if name.endswith("gate_bias")]
    assert len(biases) == 4 and all(torch.equal(b, torch.full_like(b, GATE_BIAS)) for b in biases)
    gate, x = model.stack.layers["0"].attention.gate, torch.randn(2, 8, 16)
    update = torch.sigmoid(gate.w_z(torch.zeros_like(x)) + gate.u_z(x) - gate.gate_bias)
    assert float(update.detach().mean()) < 0.2  # sigmoid(-2) = 0.12: most of x passes through
