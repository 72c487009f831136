"""Informer's ProbSparse attention (Zhou et al. 2021): against a query-by-query reference of eq. 3-4, the dense
limit (every query active), causal rows never reading the future, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, dense_reference, make_core, random_qkv

LENGTH = 24


def loop_reference(q, k, v, factor: int, causal: bool) -> torch.Tensor:
    """Per head: M_i = max - mean of q_i k_j / sqrt(d) over the evenly spaced sampled keys it may see (divided by L_K
    bidirectionally, by the visible count causally); the u largest attend with softmax, the others take mean(V) or
    the mean of V up to i."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length = q.shape[2]
    count = min(length, factor * math.ceil(math.log(length)))
    sampled = [round(x) for x in torch.linspace(0, length - 1, count).tolist()]
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            measurement = []
            for i in range(length):
                seen = [j for j in sampled if j <= i or not causal]
                s = torch.stack([q[b, h, i] @ k[b, h, j] for j in seen]) / math.sqrt(q.shape[-1])
                measurement.append(float(s.detach().max() - s.detach().sum() / (len(seen) if causal else length)))
            active = set(torch.tensor(measurement).topk(count).indices.tolist())
            for i in range(length):
                last = i + 1 if causal else length
                if i in active:
                    probs = torch.softmax(k[b, h, :last] @ q[b, h, i] / math.sqrt(q.shape[-1]), 0)
                    out[b, h, i] = probs @ v[b, h, :last]
                else:
                    out[b, h, i] = v[b, h, :last].mean(0)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    core = make_core("probsparse", causal, {"factor": 2})
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(q, k, v, 2, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_every_query_active_is_dense(causal: bool) -> None:
    core = make_core("probsparse", causal, {"factor": LENGTH})
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    torch.testing.assert_close(core(q, k, v, causal=causal), dense_reference(q, k, v, causal=causal),
                               atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("probsparse", {"factor": 2}, family=family, steps=60)
