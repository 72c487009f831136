"""ETC's external global tokens (Ainslie et al. 2020): the globals' read of the sequence and the long tokens' band plus
globals against a token-by-token loop (with gradients for the global vectors, a padding mask), a decoder refused,
training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError
from xscale.models.attention.core import padding_bias

LENGTH, WINDOW, GLOBALS = 10, 2, 3


def loop_reference(core, q, k, v, real: torch.Tensor) -> torch.Tensor:
    """real: (B, T) True at real tokens; padded keys are skipped by every query."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        seen = [j for j in range(LENGTH) if real[b, j]]
        for h in range(q.shape[1]):
            summaries = []
            for t in range(GLOBALS):
                keys = torch.cat([core.global_keys[h], k[b, h, seen]])
                values = torch.cat([core.global_values[h], v[b, h, seen]])
                summaries.append(torch.softmax(keys @ core.global_queries[h, t] * scale, 0) @ values)
            for i in range(LENGTH):
                near = [j for j in seen if abs(i - j) <= WINDOW]
                keys = torch.cat([k[b, h, near], core.global_keys[h]])
                values = torch.cat([v[b, h, near], torch.stack(summaries)])
                out[b, h, i] = torch.softmax(keys @ q[b, h, i] * scale, 0) @ values
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["whole", "padded"])
def test_matches_the_loop_reference(padded: bool) -> None:
    core = make_core("etc", False, {"global_tokens": GLOBALS, "window": WINDOW}, d_model=32)
    with torch.no_grad():
        for parameter in core.parameters():
            parameter.normal_()
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    real = torch.ones(2, LENGTH, dtype=torch.bool)
    if padded:
        real[1, 7:] = False
    out = core(q, k, v, causal=False, bias=padding_bias(real, q.dtype) if padded else None)
    ref = loop_reference(core, q, k, v, real)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, v, *core.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_refuses_a_decoder_and_unsliced_per_head_state() -> None:
    with pytest.raises(ConfigError, match="attention 'etc' cannot be causally masked"):
        make_core("etc", True)
    core = make_core("etc", False, d_model=32)
    q, k, v = random_qkv(1, 2, LENGTH, 8)
    with pytest.raises(ValueError, match="holds state for 4 heads but got 2"):
        core(q, k, v, causal=False)


def test_trains() -> None:
    assert_loss_falls("etc", {"global_tokens": 2, "window": 2}, family="encoder")
