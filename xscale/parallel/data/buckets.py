"""Gradient buckets whose communication overlaps the last microbatch's backward (as PyTorch DDP, Li et al. 2020).

The parameters are grouped, in reverse registration order (roughly the order backward produces their gradients),
into buckets of at most ``bucket_bytes`` that share a dtype and a process group. Each bucket owns one flat buffer and
every parameter's ``.grad`` is a view into it (from its first accumulation in a step on), so
autograd accumulates the microbatches straight into the buffer and there is one gradient copy, not two. A post-accumulate-grad hook marks a parameter ready during the backward of the
step's last microbatch (``sync`` on); a bucket whose parameters are all ready starts its asynchronous collective at
once, while backward goes on with earlier layers. Buckets start strictly in index order, so every rank issues the same
collectives in the same order whatever order its gradients finish in; :meth:`GradientBuckets.finish` starts any left
(parameters that got no gradient, or a pipeline schedule that runs without ``sync``) and waits on all of them before
the gradients are read (clipping, optimizer).

A bucket either all-reduces its buffer in place over one group (DDP: ``shard_size`` 1), or reduce-scatters
it over the sharding group, then all-reduces the chunk over the replicate group (ZeRO-1/2, HSDP): each parameter takes
``shard_size x chunk`` elements of the buffer, and the send buffer lays the ranks' chunks of every parameter side by
side, so rank r receives its chunk of each parameter in one contiguous piece. Once the send copy is made the whole
gradients are spent (``.grad`` is None): ZeRO-1 keeps the buffer from step to step and receives its reduced chunks in
the buffer's head; ZeRO-2 frees it, and what stays is this rank's chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.parallel.collectives import reduce_scatter_flat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass
class BucketGroups:
    """Where a bucket's gradients are summed: reduce-scattered over ``shard_group`` (``shard_size`` ranks; None for
    one), then all-reduced over ``replicate_group`` (None: no one to sum with)."""

    shard_group: dist.ProcessGroup | None
    shard_size: int
    replicate_group: dist.ProcessGroup | None
    key: Hashable  # parameters with equal keys may share a bucket


@dataclass
class _Slot:
    param: nn.Parameter
    offset: int  # in the bucket's buffer
    chunk: int  # this rank's share: ceil(numel / shard_size) (numel when shard_size is 1)
    column: int  # where this parameter's chunk starts in the reduced output

    @property
    def numel(self) -> int:
        return _local(self.param).numel()


@dataclass
class GradientBucket:
    slots: list[_Slot]
    groups: BucketGroups
    dtype: torch.dtype
    device: torch.device
    keep_buffer: bool  # False (ZeRO-2): the buffer is freed once the bucket is sent
    buffer: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    handle: dist.Work | None = None
    send: torch.Tensor | None = None  # the reduce-scatter input, alive until the collective is done
    output: torch.Tensor | None = None  # this rank's reduced elements (the whole buffer when shard_size is 1)

    @property
    def size(self) -> int:
        return sum(slot.chunk for slot in self.slots) * self.groups.shard_size

    @property
    def started(self) -> bool:
        return self.output is not None

    def view(self, slot: _Slot) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer[slot.offset:slot.offset + slot.numel].view_as(_local(slot.param))

    @torch.no_grad()
    def attach(self, slot: _Slot) -> None:
        """Make ``slot``'s parameter's gradient a view of the buffer (copying a gradient autograd allocated, zeroing
        the slot of a parameter without one)."""
        if self.buffer is None:  # each slot is copied or zeroed before the bucket is sent; padding is never read
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
        param, view = slot.param, self.view(slot)
        grad = param.grad
        if grad is None:
            view.zero_()
        elif _local(grad).data_ptr() != view.data_ptr():
            view.copy_(_local(grad))
        else:
            return
        param.grad = _as_gradient(param, view)

    @torch.no_grad()
    def start(self) -> None:
        """Start this bucket's collective (asynchronous)."""
        for slot in self.slots:
            self.attach(slot)
        assert self.buffer is not None
        groups = self.groups
        if groups.shard_size > 1:
            views = [self.buffer[slot.offset:slot.offset + slot.chunk * groups.shard_size].view(groups.shard_size, -1)
                     for slot in self.slots]
            self.send = torch.cat(views, dim=1).view(-1)  # rank-major: [rank 0's chunks | rank 1's chunks | ...]
            # the gradients are in ``send`` now: a kept buffer takes this rank's reduced chunks in its head
            chunks = self.size // groups.shard_size
            self.output = self.buffer[:chunks] if self.keep_buffer else self.buffer.new_empty(chunks)
            self.handle = reduce_scatter_flat(self.output, self.send, group=groups.shard_group, async_op=True)
        else:
            self.output = self.buffer
            if groups.replicate_group is not None:
                self.handle = dist.all_reduce(self.output, group=groups.replicate_group, async_op=True)
        if groups.shard_size > 1 or not self.keep_buffer:
            for slot in self.slots:  # a sharded bucket's whole gradients are spent (the reduced chunks replace them)
                slot.param.grad = None
        if not self.keep_buffer:
            self.buffer = None

    def wait(self) -> torch.Tensor:
        """Wait for the collective; return this rank's reduced elements."""
        assert self.output is not None
        if self.handle is not None:
            self.handle.wait()
        if self.groups.shard_size > 1 and self.groups.replicate_group is not None:
            dist.all_reduce(self.output, group=self.groups.replicate_group)
        output = self.output
        self.handle = self.send = self.output = None
        self.ready.clear()
        return output


def _as_gradient(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``param``'s gradient (a DTensor with the parameter's placements for a DTensor parameter)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local


class GradientBuckets:
    """The buckets of one strategy, their hooks, and the order they start in (see the module docstring)."""

    def __init__(self, params: list[tuple[nn.Parameter, BucketGroups]], bucket_bytes: int, keep_buffers: bool,
                 on_start: Callable[[int], None] | None = None) -> None:
        """``params``: the parameters to sum, in registration order, each with its groups; ``on_start``: called with a
        bucket's index when it starts (tests record the order)."""
        self.buckets: list[GradientBucket] = []
        open_buckets: dict[tuple, GradientBucket] = {}
        for param, groups in reversed(params):
            local = _local(param)
            key = (groups.key, local.dtype, local.device)
            bucket = open_buckets.get(key)
            chunk = math.ceil(local.numel() / groups.shard_size)
            nbytes = chunk * groups.shard_size * local.element_size()
            if bucket is None or (bucket.slots and (bucket.size * local.element_size() + nbytes > bucket_bytes)):
                bucket = GradientBucket([], groups, local.dtype, local.device, keep_buffers)
                open_buckets[key] = bucket
                self.buckets.append(bucket)
            column = sum(slot.chunk for slot in bucket.slots)
            bucket.slots.append(_Slot(param, bucket.size, chunk, column))
        self.bucket_of: dict[int, tuple[GradientBucket, _Slot]] = {
            id(slot.param): (bucket, slot) for bucket in self.buckets for slot in bucket.slots}
        self.sync = False
        self.next = 0  # the first bucket not started
        self.on_start = on_start
        for param, _ in params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        bucket, slot = self.bucket_of[id(param)]
        bucket.attach(slot)
        if not self.sync or bucket.started:
            return
        bucket.ready.add(id(param))
        self._start_ready()

    def _start_ready(self) -> None:
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if len(bucket.ready) < len(bucket.slots):
                return
            self._start(self.next)

    def _start(self, index: int) -> None:
        self.buckets[index].start()
        self.next = index + 1
        if self.on_start is not None:
            self.on_start(index)

    def finish(self) -> list[torch.Tensor]:
        """Start the buckets left, wait on every one; return each bucket's reduced elements, in bucket order."""
        for index in range(self.next, len(self.buckets)):
            self._start(index)
        outputs = [bucket.wait() for bucket in self.buckets]
        self.next, self.sync = 0, False
        return outputs

    def release(self) -> None:
        """Drop the gradients after the optimizer step (None, as ``zero_grad(set_to_none=True)`` leaves them, so code
        that stashes or replaces a gradient sees what it would without buckets); the kept buffers are reused, each
        gradient copied into its slot when it is first accumulated, which costs what zeroing the buffer would."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.grad = None
