"""Flat all-gather and reduce-scatter: their results on gloo ranks (the direct transfers xscale uses on gloo, and
torch's own collectives), with no deprecation warning from torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from spawned import WORLD, spawn

from xscale.parallel import collectives
from xscale.parallel.collectives import DirectWork, all_gather_flat, reduce_scatter_flat


def check(rank: int, direct: bool) -> None:
    collectives.GLOO_DIRECT = direct
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered = torch.empty(2 * WORLD)
        all_gather_flat(gathered, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
        assert gathered.tolist() == [0.0, 1.0, 10.0, 11.0]
        mine = torch.empty(2)
        reduce_scatter_flat(mine, torch.arange(2.0 * WORLD) * (rank + 1))
        assert mine.tolist() == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]  # rows summed over ranks: x (1 + 2)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "torch"])
def test_flat_collectives_on_two_ranks(direct: bool):
    spawn(check, direct)


def check_direct_against_torch(rank: int) -> None:
    """Several collectives in flight at once, waited on out of order, on the world and on a subgroup, 2-D outputs:
    the direct transfers give torch's results (the sums exactly: integers)."""
    world, generator = dist.get_world_size(), torch.Generator().manual_seed(rank)
    subgroup = dist.new_group([0, world - 1])  # every rank creates it; only its members use it
    fulls = [torch.randint(-50, 50, (world * 6, 3), generator=generator).float() for _ in range(3)]
    expected = []
    collectives.GLOO_DIRECT = False
    for full in fulls:
        out = torch.empty(6, 3)
        reduce_scatter_flat(out, full)
        expected.append(out)
    gathered_expected = torch.empty(world * 6, 3)
    all_gather_flat(gathered_expected, expected[0])
    collectives.GLOO_DIRECT = True
    outs = [torch.empty(6, 3) for _ in fulls]
    works = [reduce_scatter_flat(out, full, async_op=True) for out, full in zip(outs, fulls)]
    assert all(isinstance(work, DirectWork) for work in works)
    for work in reversed(works):
        work.wait()
    for out, reference in zip(outs, expected):
        torch.testing.assert_close(out, reference, atol=0, rtol=0)
    gathered = torch.empty(world * 6, 3)
    all_gather_flat(gathered, outs[0], async_op=True).wait()
    torch.testing.assert_close(gathered, gathered_expected, atol=0, rtol=0)
    if rank in (0, world - 1):  # a subgroup: its ranks are not the world's
        pair = torch.empty(4)
        all_gather_flat(pair, torch.tensor([rank, rank + 0.5]), group=subgroup)
        assert pair.tolist() == [0.0, 0.5, world - 1.0, world - 0.5]
        half = torch.empty(2)
        reduce_scatter_flat(half, torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1), group=subgroup)
        first = dist.get_rank(subgroup) == 0
        torch.testing.assert_close(half, torch.tensor([1.0, 2.0] if first else [3.0, 4.0]) * (1 + world))


@pytest.mark.parametrize("world", [2, 3])
def test_direct_transfers_equal_torchs_collectives(world: int):
    spawn(check_direct_against_torch, world=world)
