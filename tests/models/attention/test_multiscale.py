"""Multi-scale attention (Guo et al. 2020): each head against a loop over its window, the window given to a head by
its global index under a tensor-parallel slice, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.runtime import StepContext

LENGTH = 12


def loop_reference(q, k, v, windows: list[int], causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        window = windows[h * len(windows) // q.shape[1]] or LENGTH
        for i in range(LENGTH):
            keys = [j for j in range(LENGTH) if abs(i - j) <= window and (j <= i or not causal)]
            probs = torch.softmax(q[:, h, i, None, :] @ k[:, h, keys].transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
            out[:, h, i] = (probs @ v[:, h, keys])[:, 0]
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    windows = [1, 3, 0, 2]
    core = make_core("multiscale", causal, {"windows": windows})
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(q, k, v, windows, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_a_tensor_parallel_rank_applies_its_global_heads_windows() -> None:
    """Rank 1 of tp=2 holds heads 2 and 3: its output equals those heads of the whole core's."""
    core = make_core("multiscale", True, {"windows": [1, 3, 0, 2]})
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    whole = core(q, k, v, causal=True)
    rank = core(q[:, 2:], k[:, 2:], v[:, 2:], causal=True, context=StepContext(tensor_rank=1, tensor_size=2))
    torch.testing.assert_close(rank, whole[:, 2:], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("multiscale", {"windows": [1, 2, 4, 0]}, family=family)
