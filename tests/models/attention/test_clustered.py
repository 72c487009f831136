"""Clustered attention (Vyas et al. 2020): eq. 6-7 and the improved eq. 9-10 against a query-by-query loop, the
k-means fixed point, the dense limits (one cluster per query; top-k over every key), the causal refusal, training."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, dense_reference, make_core, random_qkv
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention.clustered import cluster_queries
from xscale.models.attention.core import build_core

LENGTH = 10


def loop_reference(q, k, v, assignment, topk: int) -> torch.Tensor:
    """Each query i in cluster c: the centroid's softmax over all keys; with topk, its own softmax on the centroid's
    top-k keys scaled by their centroid mass, plus the centroid's weights on the other keys."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                members = assignment[b, h] == assignment[b, h, i]
                centroid = q[b, h][members].mean(0)
                probs = torch.softmax(k[b, h] @ centroid * scale, 0)
                if topk == 0:
                    out[b, h, i] = probs @ v[b, h]
                    continue
                top = probs.topk(topk).indices
                others = torch.ones(k.shape[2], dtype=torch.bool)
                others[top] = False
                own = torch.softmax(k[b, h][top] @ q[b, h, i] * scale, 0)
                out[b, h, i] = probs[top].sum() * (own @ v[b, h][top]) + probs[others] @ v[b, h][others]
    return out


@pytest.mark.parametrize("topk", [0, 3], ids=["clustered", "improved"])
def test_matches_the_loop_reference(topk: int) -> None:
    core = make_core("clustered", False, {"clusters": 3, "iterations": 5, "topk": topk})
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=False)
    assignment = cluster_queries(q, 3, 5)
    assert len(assignment.unique()) > 1
    ref = loop_reference(q, k, v, assignment, topk)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_kmeans_reaches_a_fixed_point() -> None:
    """After enough rounds every query is nearest to its own cluster's mean."""
    q = random_qkv(1, 2, 40, 4)[0].detach()
    assignment = cluster_queries(q, 4, 50)
    for h in range(2):
        means = torch.stack([q[0, h][assignment[0, h] == c].mean(0) for c in range(4)])
        nearest = torch.cdist(q[0, h], means).argmin(-1)
        assert torch.equal(nearest, assignment[0, h])


@pytest.mark.parametrize("options", [{"clusters": LENGTH}, {"clusters": 2, "topk": LENGTH}],
                         ids=["a-cluster-per-query", "topk-every-key"])
def test_dense_limits(options: dict) -> None:
    core = make_core("clustered", False, options)
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    torch.testing.assert_close(core(q, k, v, causal=False), dense_reference(q, k, v), atol=1e-10, rtol=1e-10)


def test_refused_in_a_decoder() -> None:
    with pytest.raises(ConfigError, match="'clustered' cannot be causally masked"):
        build_core("clustered", ModelConfig(n_heads=4, d_model=64), 0, {}, True, False)


@pytest.mark.parametrize("topk", [0, 4])
def test_trains(topk: int) -> None:
    assert_loss_falls("clustered", {"clusters": 4, "topk": topk}, family="encoder", steps=60)
