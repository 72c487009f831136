"""BP-Transformer's binary-partition attention (Ye et al. 2019): against a top-down walk of the tree for each token
(a node expanded when it lies within the window of the token's ancestor, else attended as the mean of its span),
with gradients; the attended spans partition the sequence (causal: the past); training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.models.attention.binary_partition import attended_nodes, span_levels


def walk(i: int, length: int, window: int, causal: bool) -> list[tuple[int, int]]:
    """The spans [start, stop) token i attends: from the root down, expanding node (l, n) when
    floor((a - w) / 2) <= n <= floor((a + w) / 2), a = i // 2^(l - 1)."""
    top = math.ceil(math.log2(length)) if length > 1 else 0
    spans = []

    def visit(level: int, node: int) -> None:
        start = node * 2**level
        if start >= length:
            return
        below = i // 2 ** (level - 1) if level else None
        if level == top or (level > 0 and (below - window) // 2 <= node <= (below + window) // 2):
            visit(level - 1, 2 * node)
            visit(level - 1, 2 * node + 1)
        elif not causal or start <= i:
            spans.append((start, min(start + 2**level, length)))

    visit(top, 0)
    return spans


def loop_reference(q, k, v, window: int, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    for i in range(q.shape[2]):
        spans = walk(i, q.shape[2], window, causal)
        keys = torch.stack([k[:, :, start:stop].mean(2) for start, stop in spans], 2)
        values = torch.stack([v[:, :, start:stop].mean(2) for start, stop in spans], 2)
        probs = torch.softmax(q[:, :, i, None] @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        out[:, :, i] = (probs @ values)[:, :, 0]
    return out


@pytest.mark.parametrize("length,window", [(16, 1), (23, 2), (37, 1), (2, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_spans_partition_the_visible_sequence(length: int, window: int, causal: bool) -> None:
    allowed = attended_nodes(length, window, causal, torch.device("cpu"))
    for i in range(length):
        spans = walk(i, length, window, causal)
        covered = sorted(position for start, stop in spans for position in range(start, stop))
        assert covered == list(range(i + 1 if causal else length))
        assert int(allowed[i].sum()) == len(spans)
    assert allowed.shape[1] == length + sum(-(-length // 2**level) for level in span_levels(length))


@pytest.mark.parametrize("length,window", [(16, 1), (23, 2)])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_tree_walk(length: int, window: int, causal: bool) -> None:
    core = make_core("bpt", causal, {"window": window})
    q, k, v = random_qkv(2, 4, length, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(q, k, v, window, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_a_token_attends_logarithmically_many_nodes() -> None:
    allowed = attended_nodes(1024, 2, False, torch.device("cpu"))
    assert int(allowed.sum(1).max()) <= (2 + 2) * math.log2(1024)  # 28 here; dense would be 1024


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("bpt", {"window": 1}, family=family)
