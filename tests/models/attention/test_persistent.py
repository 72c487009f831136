"""Persistent memory vectors (Sukhbaatar et al. 2019): eq. 6-7 against a query-by-query loop over the visible context
keys and every persistent vector, with gradients for the vectors, a tensor-parallel head slice, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv

LENGTH = 9


def loop_reference(core, q, k, v, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        for i in range(LENGTH):
            last = i + 1 if causal else LENGTH
            keys = torch.cat([k[:, h, :last], core.persistent_keys[h].expand(q.shape[0], -1, -1)], 1)
            values = torch.cat([v[:, h, :last], core.persistent_values[h].expand(q.shape[0], -1, -1)], 1)
            probs = torch.softmax((keys @ q[:, h, i, :, None])[..., 0] / math.sqrt(q.shape[-1]), -1)
            out[:, h, i] = (probs[:, None, :] @ values)[:, 0]
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    core = make_core("persistent", causal, {"persistent_vectors": 3}, d_model=32)
    with torch.no_grad():
        core.persistent_keys.normal_()
        core.persistent_values.normal_()
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(core, q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, v, core.persistent_keys, core.persistent_values)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_refuses_unsliced_per_head_state() -> None:
    core = make_core("persistent", True, d_model=32)
    q, k, v = random_qkv(1, 2, LENGTH, 8)
    with pytest.raises(ValueError, match="holds state for 4 heads but got 2"):
        core(q, k, v, causal=True)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("persistent", {"persistent_vectors": 4}, family=family)
