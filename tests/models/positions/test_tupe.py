"""TUPE (Ke et al. 2021): the positional correlation plus relative bias against a loop over heads and positions (with
gradients), TUPE-A without the relative term, a context-parallel rank's rows, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls
from xscale.models.positions.tupe import TupeOptions, UntiedPositionalAttention
from xscale.runtime import StepContext

HEADS, HEAD_DIM, LENGTH = 2, 4, 7


def _tupe(relative: bool) -> UntiedPositionalAttention:
    torch.manual_seed(0)
    tupe = UntiedPositionalAttention(HEADS * HEAD_DIM, HEADS, HEAD_DIM, 16, False,
                                     options=TupeOptions(num_buckets=8, max_distance=16, relative=relative)).double()
    for parameter in tupe.parameters():
        torch.nn.init.normal_(parameter)
    return tupe


def loop_reference(tupe: UntiedPositionalAttention, relative: bool) -> torch.Tensor:
    out = torch.zeros(HEADS, LENGTH, LENGTH, dtype=torch.float64)
    u_q = tupe.query.weight.view(HEADS, HEAD_DIM, -1)
    u_k = tupe.key.weight.view(HEADS, HEAD_DIM, -1)
    for h in range(HEADS):
        for i in range(LENGTH):
            for j in range(LENGTH):
                value = (u_q[h] @ tupe.table[i]) @ (u_k[h] @ tupe.table[j]) / math.sqrt(2 * HEAD_DIM)
                if relative:
                    value = value + tupe.weight[tupe._bucket(torch.tensor(j - i)), h]
                out[h, i, j] = value
    return out


@pytest.mark.parametrize("relative", [True, False], ids=["tupe-r", "tupe-a"])
def test_matches_the_loop_reference(relative: bool) -> None:
    tupe = _tupe(relative)
    out = tupe.bias(LENGTH, LENGTH, slice(0, HEADS))
    ref = loop_reference(tupe, relative)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    parameters = [p for p in tupe.parameters()]
    got = torch.autograd.grad(out, parameters, grad, allow_unused=True)
    want = torch.autograd.grad(ref, parameters, grad, allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_head_slice_and_a_context_parallel_rank_take_their_rows() -> None:
    class Held:  # the last 3 positions of a 7-token sequence
        def coordinates(self, size, device):
            return torch.arange(4, 7, device=device)

        def global_size(self, size):
            return 7

    tupe = _tupe(True)
    whole = tupe.bias(LENGTH, LENGTH, slice(0, HEADS))
    torch.testing.assert_close(tupe.bias(LENGTH, LENGTH, slice(1, 2)), whole[1:])
    torch.testing.assert_close(tupe.bias(3, 3, slice(0, HEADS), StepContext(sequence=Held())), whole[:, 4:])


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("dense", family=family, position="tupe")
