"""Gradient buckets: collectives start during the last microbatch's backward, in bucket order, on one buffer.

One process with a one-rank gloo group: the collectives are real (asynchronous, returning work handles) and sum
over one rank, so the reduced gradients are the local ones; two spawned ranks check a reduce-scattered (ZeRO) bucket;
whole layouts are the parity tests' job.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from spawned import spawn
from torch import nn

from xscale.parallel.data.buckets import BucketGroups, GradientBuckets


@contextlib.contextmanager
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _backward(model: nn.Sequential, seed: int, events: list) -> None:
    """Backward of a small loss; ``events`` gets "first layer reached" when backward reaches the first layer's
    output, i.e. after every later layer's gradients and before the first layer's."""
    torch.manual_seed(seed)
    hidden = model[0](torch.randn(3, 8))
    hidden.register_hook(lambda grad: events.append("first layer reached"))
    model[1:](hidden).square().sum().backward()


def _reference_grads(seeds: list[int]) -> list[torch.Tensor]:
    model = _model()
    for seed in seeds:
        _backward(model, seed, [])
    return [param.grad.clone() for param in model.parameters()]


def _buckets(model: nn.Module, group, events: list, forward_order: bool = False) -> GradientBuckets:
    params = list(model.parameters())
    if forward_order:  # buckets in forward order: the first bucket becomes ready last
        params.reverse()
    entries = [(param, BucketGroups(None, 1, group, "dp")) for param in params]
    bytes_per_layer = (8 * 8 + 8) * 4
    return GradientBuckets(entries, bytes_per_layer, keep_buffers=True, on_start=lambda i: events.append(i))


def test_buckets_start_during_the_last_backward_and_gradients_live_in_their_buffers():
    with one_rank_group() as group:
        model, events = _model(), []
        buckets = _buckets(model, group, events)
        assert len(buckets.buckets) == 3  # one per layer (weight and bias together)
        buckets.sync = False
        _backward(model, 1, events)
        assert events == ["first layer reached"], "a collective started on a microbatch that only accumulates"
        events.clear()
        buckets.sync = True
        _backward(model, 2, events)
        assert events[:2] == [0, 1] and "first layer reached" in events, \
            f"the last layers' buckets must start before backward reaches the first layer: {events}"
        buckets.finish()
        assert events[-1] == 2
        for param, expected in zip(model.parameters(), _reference_grads([1, 2])):
            torch.testing.assert_close(param.grad, expected)
            bucket, _ = buckets.bucket_of[id(param)]
            start = bucket.buffer.data_ptr()
            assert start <= param.grad.data_ptr() < start + bucket.buffer.numel() * 4, "a second gradient copy"
        buckets.release()
        assert all(param.grad is None for param in model.parameters())
        buckets.sync = True  # the next step accumulates into the same buffers
        _backward(model, 5, events)
        buckets.finish()
        for param, expected in zip(model.parameters(), _reference_grads([5])):
            torch.testing.assert_close(param.grad, expected)
            assert buckets.bucket_of[id(param)][0].buffer.data_ptr() <= param.grad.data_ptr()


def test_buckets_start_in_index_order_whatever_order_gradients_finish_in():
    with one_rank_group() as group:
        model, events = _model(), []
        buckets = _buckets(model, group, events, forward_order=True)
        buckets.sync = True
        _backward(model, 3, events)
        assert events == ["first layer reached", 0, 1, 2], events
        buckets.finish()
        for param, expected in zip(model.parameters(), _reference_grads([3])):
            torch.testing.assert_close(param.grad, expected)


def test_finish_starts_buckets_whose_parameters_got_no_gradient():
    with one_rank_group() as group:
        model, events = _model(), []
        buckets = _buckets(model, group, events)
        model[4].requires_grad_(False)  # bucket 0 never becomes ready
        buckets.sync = True
        _backward(model, 4, events)
        assert events == ["first layer reached"]
        buckets.finish()
        assert [e for e in events if isinstance(e, int)] == [0, 1, 2]
        assert not model[4].weight.grad.any()


def check_sharded_bucket(rank: int, keep_buffers: bool) -> None:
    """Two ranks, one bucket reduce-scattered (ZeRO-1 keeps its buffer, ZeRO-2 frees it), two steps."""
    model = _model()
    entries = [(param, BucketGroups(dist.group.WORLD, 2, None, "dp")) for param in model.parameters()]
    buckets = GradientBuckets(entries, 2**20, keep_buffers=keep_buffers)
    (bucket,) = buckets.buckets
    kept = None
    for seeds in ([1, 2], [3, 4]):
        buckets.sync = True
        _backward(model, seeds[rank], [])
        (reduced,) = buckets.finish()
        total = [a + b for a, b in zip(*(_reference_grads([seed]) for seed in seeds))]
        by_param = dict(zip(map(id, model.parameters()), total))
        for slot in bucket.slots:
            flat = by_param[id(slot.param)].view(-1)
            start, stop = min(rank * slot.chunk, flat.numel()), min((rank + 1) * slot.chunk, flat.numel())
            torch.testing.assert_close(reduced[slot.column:slot.column + stop - start], flat[start:stop])
            assert slot.param.grad is None, "a whole gradient left after its bucket was reduce-scattered"
        if keep_buffers:  # the reduced chunks land in the kept buffer's head, the same memory every step
            assert reduced.data_ptr() == bucket.buffer.data_ptr()
            assert kept in (None, bucket.buffer.data_ptr())
            kept = bucket.buffer.data_ptr()
        else:
            assert bucket.buffer is None
        buckets.release()


@pytest.mark.parametrize("keep_buffers", [True, False], ids=["zero1", "zero2"])
def test_a_sharded_bucket_gives_each_rank_its_summed_chunks(keep_buffers):
    spawn(check_sharded_bucket, keep_buffers)
