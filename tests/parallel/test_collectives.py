"""Flat all-gather and reduce-scatter: their results on gloo ranks (the direct transfers xscale uses on gloo, and
torch's own collectives), with no deprecation warning from torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from spawned import WORLD, spawn

from xscale.parallel.collectives import (
    GLOO_DIRECT,
    DirectWork,
    all_gather_flat,
    direct_all_gather,
    direct_reduce_scatter,
    reduce_scatter_flat,
    torch_all_gather,
    torch_reduce_scatter,
)

WAYS = {"flat": (all_gather_flat, reduce_scatter_flat), "direct": (direct_all_gather, direct_reduce_scatter),
        "torch": (torch_all_gather, torch_reduce_scatter)}


def check(rank: int, way: str) -> None:
    all_gather, reduce_scatter = WAYS[way]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered = torch.empty(2 * WORLD)
        all_gather(gathered, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
        assert gathered.tolist() == [0.0, 1.0, 10.0, 11.0]
        mine = torch.empty(2)
        reduce_scatter(mine, torch.arange(2.0 * WORLD) * (rank + 1))
        assert mine.tolist() == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]  # rows summed over ranks: x (1 + 2)
        if way == "flat" and GLOO_DIRECT:  # on gloo the flat collectives are the direct transfers
            work = all_gather_flat(gathered, torch.zeros(2), async_op=True)
            assert isinstance(work, DirectWork)
            work.wait()


@pytest.mark.parametrize("way", list(WAYS))
def test_flat_collectives_on_two_ranks(way: str):
    spawn(check, way)


def check_direct_against_torch(rank: int) -> None:
    """Several collectives in flight at once, waited on out of order, on the world and on a subgroup, 2-D outputs:
    the direct transfers give torch's results (the sums exactly: integers)."""
    world, generator = dist.get_world_size(), torch.Generator().manual_seed(rank)
    subgroup = dist.new_group([0, world - 1])  # every rank creates it; only its members use it
    fulls = [torch.randint(-50, 50, (world * 6, 3), generator=generator).float() for _ in range(3)]
    expected = []
    for full in fulls:
        out = torch.empty(6, 3)
        torch_reduce_scatter(out, full)
        expected.append(out)
    gathered_expected = torch.empty(world * 6, 3)
    torch_all_gather(gathered_expected, expected[0])
    outs = [torch.empty(6, 3) for _ in fulls]
    works = [direct_reduce_scatter(out, full, async_op=True) for out, full in zip(outs, fulls)]
    assert all(isinstance(work, DirectWork) for work in works)
    for work in reversed(works):
        work.wait()
    for out, reference in zip(outs, expected):
        torch.testing.assert_close(out, reference, atol=0, rtol=0)
    gathered = torch.empty(world * 6, 3)
    direct_all_gather(gathered, outs[0], async_op=True).wait()
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
