"""Reversible residual stack (RevNet / Reformer): gradients as the plain two-half computation's, memory flat in depth."""

from __future__ import annotations

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.estimate.measure import activation_peak_tracker_class
from xscale.models import build_model
from xscale.models.stacks import Stack
from xscale.runtime import StepContext

SMALL = dict(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=16, dropout=0.1, attention_dropout=0.1,
             stack="reversible")


def _reference(stack: Stack, x: torch.Tensor, context: StepContext) -> torch.Tensor:
    """Y1 = X1 + F(X2), Y2 = X2 + G(Y1) from (x, x), output (Y1 + Y2) / 2, under ordinary autograd."""
    x1 = x2 = x
    for depth, block in zip(stack.depths, stack.blocks()):
        block_context = context.at_depth(depth) if stack.share_layers else context
        x1 = x1 + block.attention.branch(x2, stack.position, context=block_context)
        x2 = x2 + block.feed_forward.branch(x1, context=block_context)
    return (x1 + x2) / 2


def _gradients(stack: Stack, x: torch.Tensor, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    weights = torch.linspace(-1, 1, x.numel()).view_as(x)
    parameters = list(stack.parameters())
    (forward(x) * weights).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]
    stack.zero_grad(set_to_none=True)
    return x.grad, grads


def _assert_round_off(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal within fp32 round-off of the tensor's scale (rebuilt inputs differ from the kept ones by a few ulp)."""
    error = (got - expected).abs().max().item()
    assert error <= 1e-5 * expected.abs().max().item() + 1e-8, f"{name}: max difference {error}"


@pytest.mark.parametrize("options,context", [
    ({}, StepContext(seed=7, step=3)),
    ({"norm_placement": "sandwich", "position": "t5_bias", "ffn": "gelu"}, StepContext(seed=1)),
    ({"share_layers": True}, StepContext(seed=2)),
    ({}, StepContext()),  # dropout from torch's generator: replayed from its saved state
], ids=["pre-rope", "sandwich-t5bias", "shared", "unpositioned"])
def test_gradients_equal_the_plain_computation(options, context):
    torch.manual_seed(0)
    stack = build_model(ModelConfig(**{**SMALL, **options})).stack.train()
    x = torch.randn(2, 8, 16)
    state = torch.get_rng_state()
    expected_x, expected = _gradients(stack, x, lambda h: _reference(stack, h, context))
    torch.set_rng_state(state)
    got_x, got = _gradients(stack, x, lambda h: stack(h, None, None, context)[0])
    _assert_round_off(got_x, expected_x, "input")
    assert any(grad.abs().sum() > 0 for grad in expected)
    for (name, _), a, b in zip(stack.named_parameters(), got, expected, strict=True):
        _assert_round_off(a, b, name)


def test_output_is_the_mean_of_the_halves_and_evaluation_runs_the_same_blocks():
    torch.manual_seed(0)
    stack = build_model(ModelConfig(**{**SMALL, "dropout": 0.0, "attention_dropout": 0.0})).stack
    x = torch.randn(2, 8, 16)
    trained = stack(x, None, None, StepContext())[0]
    with torch.no_grad():
        evaluated = stack(x, None, None, StepContext())[0]
    torch.testing.assert_close(trained, _reference(stack, x, StepContext()))
    torch.testing.assert_close(evaluated, trained)


def _saved_bytes(n_layers: int, reversible: bool) -> int:
    """Bytes autograd keeps for backward after a forward of the whole model."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**SMALL, "n_layers": n_layers, "stack": "reversible" if reversible else "plain"}))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        model(torch.randint(0, 64, (2, 16)))
    return sum(saved)


def test_forward_keeps_for_backward_what_does_not_grow_with_depth():
    """The reversible stack saves its two output halves only (its blocks' inputs are rebuilt in backward)."""
    assert _saved_bytes(8, True) == _saved_bytes(2, True)
    assert _saved_bytes(8, False) > 3 * _saved_bytes(2, False)


def _activation_peak(n_layers: int, reversible: bool) -> int:
    """Peak bytes of activations and temporaries of a forward and backward (``xscale inspect --measure``'s tracker,
    on real tensors: parameters, buffers and gradients are not counted)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=n_layers, max_seq_len=32,
                                    ffn="gelu", stack="reversible" if reversible else "plain"))
    tracker = activation_peak_tracker_class()()
    tracker.track_external(model)
    with tracker:
        model(torch.randint(0, 32, (2, 32))).logsumexp(-1).mean().backward()
    return tracker.activation_peak


@pytest.mark.slow
def test_activation_memory_is_flat_in_depth():
    """2 and 8 reversible layers within 15% (measured: equal), while the standard stack's peak grows about
    linearly (measured: x3.3). ~15 s on 2 loaded cores."""
    reversible = {n: _activation_peak(n, True) for n in (2, 8)}
    standard = {n: _activation_peak(n, False) for n in (2, 8)}
    assert reversible[8] / reversible[2] < 1.15, reversible
    assert standard[8] / standard[2] > 2.5, standard


@pytest.mark.parametrize("overrides,message", [
    (["model.norm_placement=post"], "model.norm_placement=pre, sandwich or rezero"),
    (["model.norm_placement=deepnorm"], "a deepnorm layer"),
    (["model.family=encoder_decoder"], "model.family=decoder or encoder"),
    (["model.moe.num_experts=2"], "MoE"),
    (["model.attention.kind=realformer"], "realformer"),
])
def test_refused_model_options(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, ["model.stack=reversible", *overrides])


def test_config_default_is_the_plain_stack():
    assert Config().model.stack.kind == "plain"
