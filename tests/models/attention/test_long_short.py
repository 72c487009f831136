"""Long-Short Transformer attention (Zhu et al. 2021): eq. 3-4 against a query-by-query loop (window keys, projected
keys written as explicit weighted sums), causal segments never reading the future, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv

LENGTH = 14


def loop_reference(core, q, k, v, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    window, rank = core.options.window, core.options.rank
    segment = core.options.segment if causal else LENGTH
    w = core.projection.weight  # (r, d)
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            projected = []  # (segment end, key, value) for every projected slot
            for start in range(0, LENGTH, segment):
                stop = min(start + segment, LENGTH)
                for r in range(rank):
                    weights = torch.softmax(torch.stack([k[b, h, j] @ w[r] for j in range(start, stop)]), 0)
                    key = sum(weights[j - start] * k[b, h, j] for j in range(start, stop))
                    value = sum(weights[j - start] * v[b, h, j] for j in range(start, stop))
                    end = start + segment - 1
                    projected.append((end, core.global_norm(key), core.global_norm(value)))
            for i in range(LENGTH):
                keys, values = [], []
                for j in range(LENGTH):
                    if abs(i - j) <= window and (j <= i or not causal):
                        keys.append(core.local_norm(k[b, h, j]))
                        values.append(core.local_norm(v[b, h, j]))
                for end, key, value in projected:
                    if end <= i or not causal:
                        keys.append(key)
                        values.append(value)
                probs = torch.softmax(torch.stack(keys) @ q[b, h, i] / math.sqrt(q.shape[-1]), 0)
                out[b, h, i] = probs @ torch.stack(values)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    core = make_core("long_short", causal, {"window": 2, "rank": 3, "segment": 4}, d_model=32)
    q, k, v = random_qkv(1, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(core, q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, v, *core.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_causal_never_reads_the_future() -> None:
    core = make_core("long_short", True, {"window": 2, "rank": 3, "segment": 4}, d_model=32)
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    changed_k, changed_v = k.detach().clone(), v.detach().clone()
    changed_k[:, :, 9:] = torch.randn_like(changed_k[:, :, 9:])  # not a shift: the LayerNorms would remove it
    changed_v[:, :, 9:] = torch.randn_like(changed_v[:, :, 9:])
    torch.testing.assert_close(core(q, changed_k, changed_v, causal=True)[:, :, :9],
                               core(q, k, v, causal=True)[:, :, :9])


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("long_short", {"window": 2, "rank": 4, "segment": 4}, family=family)
