"""ZeRO-1/2's all-gather after the optimizer step: every rank's updated chunks back into the whole parameters.

The chunks are gathered a bucket at a time, not a parameter at a time: the parameters sharded over one group are
grouped, in order, into buckets of at most ``bucket_bytes`` (whole parameters), each rank packs its chunks of a
bucket side by side (a short last chunk padded) into its own row of the gathered tensor and one collective gathers every rank's pack, rank-major, so
parameter p's elements are the columns of its chunk in each rank's row, in rank order. All the buckets start
before the first is unpacked, so unpacking one overlaps the next one's transfer.

:meth:`ChunkGather.start` starts them and returns: the buckets are then *pending* until :meth:`ChunkGather.wait_through`
unpacks them in order (the next forward does it module by module, :mod:`xscale.parallel.data.gather_hooks`, so the
transfer of later layers overlaps the forward of earlier ones, as Megatron's ``overlap_param_gather``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from xscale.parallel.collectives import all_gather_flat


@dataclass
class GatherSlot:
    """One parameter in a gather bucket: ``full`` its flat local tensor, ``chunk`` this rank's part of it (the view
    of ``full`` from rank x ``chunk_size`` on; at most ``chunk_size`` elements), ``column`` where it starts in a
    rank's pack."""

    full: torch.Tensor
    chunk: torch.Tensor
    chunk_size: int
    column: int


@dataclass
class _Bucket:
    group: dist.ProcessGroup
    size: int  # ranks in ``group``
    rank: int  # this rank's place in ``group``
    slots: list[GatherSlot]

    @property
    def columns(self) -> int:
        return sum(slot.chunk_size for slot in self.slots)


def _pack(row: torch.Tensor, slots: list[GatherSlot]) -> None:
    """This rank's chunks side by side in ``row`` (its row of the gathered tensor), each padded to its
    ``chunk_size``: the all-gather then sends from where it receives, with no copy of its own."""
    for slot in slots:
        numel = slot.chunk.numel()
        row[slot.column:slot.column + numel].copy_(slot.chunk)
        row[slot.column + numel:slot.column + slot.chunk_size].zero_()


def _unpack(gathered: torch.Tensor, slot: GatherSlot, rank: int) -> None:
    """Copy ``slot``'s columns of every other rank's row of ``gathered`` ([ranks, columns]) into its whole tensor."""
    numel, chunk = slot.full.numel(), slot.chunk_size
    rows, rest = divmod(numel, chunk)
    columns = gathered[:, slot.column:slot.column + chunk]
    whole = slot.full[:rows * chunk].view(rows, chunk)
    for first, last in ((0, min(rank, rows)), (rank + 1, rows)):
        if first < last:
            whole[first:last].copy_(columns[first:last])
    if rest and rows != rank:
        slot.full[rows * chunk:].copy_(columns[rows, :rest])


class ChunkGather:
    """The buckets of one strategy's sharded parameters, gathered by :meth:`gather` (module docstring)."""

    def __init__(self, slots: list[tuple[GatherSlot, dist.ProcessGroup, int]], bucket_bytes: int) -> None:
        """``slots``: each sharded parameter's slot (``column`` is set here) with its group and the group's size."""
        self.buckets: list[_Bucket] = []
        open_buckets: dict[tuple, _Bucket] = {}
        for slot, group, size in slots:
            key = (group, slot.full.dtype, slot.full.device)
            bucket = open_buckets.get(key)
            nbytes = slot.chunk_size * size * slot.full.element_size()
            if bucket is None or (bucket.slots and (bucket.columns * size * slot.full.element_size() + nbytes
                                                    > bucket_bytes)):
                bucket = _Bucket(group, size, dist.get_rank(group), [])
                open_buckets[key] = bucket
                self.buckets.append(bucket)
            slot.column = bucket.columns
            bucket.slots.append(slot)

        self.pending: list[tuple[_Bucket, torch.Tensor, torch.Tensor, object] | None] = []  # None: unpacked
        self.unpacked = 0  # buckets of the last start() unpacked so far

    def bucket_index(self) -> dict[int, int]:
        """id(slot) -> the index of the bucket that fills it."""
        return {id(slot): index for index, bucket in enumerate(self.buckets) for slot in bucket.slots}

    @torch.no_grad()
    def start(self) -> None:
        """Start every bucket's all-gather (asynchronous); :meth:`wait_through` or :meth:`finish` unpack them."""
        self.finish()
        for bucket in self.buckets:
            gathered = bucket.slots[0].full.new_empty(bucket.size, bucket.columns)
            row = gathered[bucket.rank]
            _pack(row, bucket.slots)
            self.pending.append((bucket, gathered, row, all_gather_flat(gathered.view(-1), row, bucket.group,
                                                                       async_op=True)))
        self.unpacked = 0

    @torch.no_grad()
    def wait_through(self, index: int) -> None:
        """Unpack the pending buckets up to ``index`` (inclusive), in order; nothing when none is pending."""
        while self.unpacked <= index and self.unpacked < len(self.pending):
            bucket, gathered, _, handle = self.pending[self.unpacked]
            handle.wait()
            for slot in bucket.slots:
                _unpack(gathered, slot, bucket.rank)
            self.pending[self.unpacked] = None  # its gathered copy is freed now, not when the last bucket lands
            self.unpacked += 1
        if self.unpacked == len(self.pending):
            self.pending = []
            self.unpacked = 0

    @property
    def in_flight(self) -> bool:
        return bool(self.pending)

    def finish(self) -> None:
        """Unpack every pending bucket."""
        self.wait_through(len(self.buckets))

    def gather(self) -> None:
        """Fill every parameter with every rank's chunk, now."""
        self.start()
        self.finish()
