"""The Feedback Transformer (xscale/models/stacks/feedback.py): every position recomputed from scratch by a
hand-written loop over its prefix (outputs and gradients), causality, a tiny decoder that learns, and the settings
it refuses by name."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.test_components_train import _batch
from xscale.config.check import validate
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models import build_model
from xscale.parallel.checks import resolve_dims
from xscale.parallel.model import ParallelModel
from xscale.runtime import StepContext
from xscale.train.step import forward_backward_step


def _model(**overrides):
    config = ModelConfig(**dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, position="learned",
                                norm="layernorm", ffn="relu", bias=True, stack="feedback") | overrides)
    return build_model(config, seed=0)


def _attend_by_hand(attention, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Multi-head softmax(q k^T / sqrt(d_h)) v of one query (B, D) over keys (B, S, D), then W_O."""
    heads = attention.n_heads
    q = attention.wq(query).unflatten(-1, (heads, -1))  # (B, H, dh)
    k, v = attention.wk(keys).unflatten(-1, (heads, -1)), attention.wv(keys).unflatten(-1, (heads, -1))
    weights = (torch.einsum("bhd,bshd->bhs", q, k) / math.sqrt(q.shape[-1])).softmax(-1)
    return attention.wo(torch.einsum("bhs,bshd->bhd", weights, v).flatten(1))


def _last_output_by_hand(stack, x: torch.Tensor) -> torch.Tensor:
    """The top layer's state at the last position of ``x`` (B, P, D), computed from scratch: steps 0..P-1 in turn,
    m_tau = sum_l softmax(w)_l x_tau^l, each block: x + Attn(norm(x), norm(m_<t)) (W_O bias at t = 0), then its FFN."""
    weights = stack.layer_weights.softmax(0)
    memories = []
    for step in range(x.shape[1]):
        h, states = x[:, step], [x[:, step]]
        for block in stack.blocks():
            attention = block.attention
            if memories:
                past = attention.norm(torch.stack(memories, dim=1))
                h = h + _attend_by_hand(attention.sublayer, attention.norm(h), past)
            else:  # nothing to attend to: a zero weighted sum, then W_O's bias
                h = h + attention.sublayer.wo.bias
            ffn = block.feed_forward
            h = h + ffn.sublayer.w_out(torch.relu(ffn.sublayer.w_in(ffn.norm(h))))
            states.append(h)
        memories.append(sum(weight * state for weight, state in zip(weights, states)))
    return h


def test_each_position_matches_a_from_scratch_loop_over_its_prefix_outputs_and_gradients() -> None:
    stack = _model(n_layers=3).stack
    with torch.no_grad():
        stack.layer_weights.normal_()  # not near-uniform, so a wrong layer's weight shows
    x = torch.randn(2, 5, 16, requires_grad=True)
    out, _ = stack(x, None, None, StepContext())
    reference_x = x.detach().clone().requires_grad_(True)
    reference = torch.stack([_last_output_by_hand(stack, reference_x[:, :length]) for length in range(1, 6)], dim=1)
    torch.testing.assert_close(out, reference)
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in stack.named_parameters() if p.grad is not None}
    stack.zero_grad()
    reference.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad)
    assert "layer_weights" in grads
    for name, p in stack.named_parameters():
        if p.grad is not None or name in grads:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_changing_a_future_token_changes_no_earlier_output() -> None:
    model = _model()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 32
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_a_tiny_feedback_decoder_learns() -> None:
    """The periodic task of test_components_train.py; each forward is 16 sequential steps of 2 blocks."""
    torch.manual_seed(0)
    model = _model(d_model=32, n_heads=4, ffn="swiglu", norm="rmsnorm", bias=False)
    engine = ParallelModel([model], micro_batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        losses.append(float(forward_backward_step(engine, _batch("decoder", step))))
        optimizer.step()
        optimizer.zero_grad()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"loss went from {first:.3f} to {last:.3f}"


TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.seq_len=16",
        "data.dataset=copy", "model.position=learned", "model.max_seq_len=16", "model.stack=feedback"]


@pytest.mark.parametrize("overrides,message", [
    (["model.family=encoder"], r"is a decoder .*got model.family=encoder.*set model.family=decoder"),
    (["parallel.tp=2"], r"parallel.tp=2 is refused with model.stack=feedback: the memory's layer weights"),
    (["parallel.pp=2"], r"parallel.pp=2 is refused with model.stack=feedback: each step's memory mixes every"),
    (["parallel.cp=2"], r"parallel.cp=2 is refused with model.stack=feedback: each step reads the memory"),
    (["model.position=rope"], r"no relative positions for model.position=rope"),
    (["model.attention.kind=local"], r"attends densely to the memory"),
    (["model.norm_placement=post"], r"runs pre-norm standard blocks"),
    (["model.moe.num_experts=4"], r"takes neither MoE layers"),
])
def test_refused_with_the_reason_and_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _check(*overrides)


def _check(*overrides: str) -> None:
    """The config's checks, then the layout's on a world of 2 (where the stack's traits are read)."""
    config = load_config_from_cli(None, [*TINY, *overrides])
    validate(config)
    resolve_dims(config, 2)


def test_taken_settings_pass() -> None:
    _check("parallel.zero_stage=3", "parallel.activation_checkpointing=full")
