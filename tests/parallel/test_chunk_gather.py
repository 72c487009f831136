"""ZeRO-1/2's bucketed all-gather: every rank's chunk lands in every rank's whole parameters, uneven chunks and
empty ones (more ranks than elements) included, over several buckets; started buckets land only when waited for,
in order, at most a window of them in flight."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from spawned import spawn

from xscale.parallel.data.gather import ChunkGather, GatherSlot

SHAPES = [(4, 3), (5,), (1,), (7, 2), (2,)]  # 12, 5, 1, 14, 2 elements


def _targets() -> list[torch.Tensor]:
    return [torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + 100 * index
            for index, shape in enumerate(SHAPES)]


def _holding_own_chunks(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple]]:
    """Targets, parameters stale (-1) everywhere but this rank's chunk, and their gather slots over the world."""
    targets = _targets()
    params = [torch.full_like(target, -1.0) for target in targets]
    slots = []
    for param, target in zip(params, targets):
        flat, chunk = param.view(-1), math.ceil(param.numel() / world)
        start, stop = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
        flat[start:stop] = target.view(-1)[start:stop]
        slots.append((GatherSlot(flat, flat[start:stop], chunk, 0), dist.group.WORLD, world))
    return targets, params, slots


def check(rank: int, bucket_bytes: int, buckets: int) -> None:
    targets, params, slots = _holding_own_chunks(rank, dist.get_world_size())
    gather = ChunkGather(slots, bucket_bytes)
    assert len(gather.buckets) == buckets
    gather.gather()
    for param, target in zip(params, targets):
        assert torch.equal(param, target)


@pytest.mark.parametrize(("bucket_bytes", "buckets"), [(32 * 2**20, 1), (64, 4)])  # 64 bytes: [12] [5, 1] [14] [2] elements
def test_chunks_are_gathered_into_whole_parameters_on_three_ranks(bucket_bytes, buckets):
    spawn(check, bucket_bytes, buckets, world=3)


def check_started(rank: int) -> None:
    world = dist.get_world_size()
    targets, params, slots = _holding_own_chunks(rank, world)
    # two ranks' chunks of 64 bytes at most: [12] [5, 1] [14, 2] elements (48, 48, 64 bytes); two fit the window
    gather = ChunkGather(slots, 64, window_bytes=100)
    assert gather.bucket_index() == {id(slot): index for (slot, _, _), index in zip(slots, [0, 1, 1, 2, 2])}
    gather.start()
    assert gather.in_flight and all((param == -1).any() for param in params if param.numel() >= world)  # no wait yet
    assert sorted(gather.pending) == [0, 1]  # the window: 96 bytes in flight, the third bucket not started
    gather.wait_through(1)
    assert all(torch.equal(param, target) for param, target in zip(params[:3], targets[:3]))
    assert sorted(gather.pending) == [2]  # unpacked copies freed at once, the next bucket started
    assert (params[3] == -1).any() and (params[4] == -1).any()
    gather.wait_through(0)  # already there: nothing to do
    gather.finish()
    assert not gather.in_flight
    assert all(torch.equal(param, target) for param, target in zip(params, targets))
    gather.finish()  # nothing pending: nothing to do


def test_started_buckets_land_in_order_when_waited_for():
    spawn(check_started, world=2)
