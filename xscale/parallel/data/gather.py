"""ZeRO-1/2's all-gather after the optimizer step: every rank's updated chunks back into the whole parameters.

The chunks are gathered a bucket at a time, not a parameter at a time: the parameters sharded over one group are
grouped, in order, into buckets of at most ``bucket_bytes`` (whole parameters), each rank packs its chunks of a
bucket side by side (a short last chunk padded) into its own row of the gathered tensor and one collective gathers
every rank's pack, rank-major, so parameter p's elements are the columns of its chunk in each rank's row, in rank
order. At most ``window_bytes`` of buckets are in flight (one bucket, if it is larger): unpacking one frees its
gathered copy and starts the next ones that fit, so the transfer of the next buckets overlaps the unpacking, and the
gathered copies stay within the window (as FSDP limits its all-gathers in flight), whatever the model's size.

:meth:`ChunkGather.start` starts them and returns: the buckets are then *in flight* until :meth:`ChunkGather.wait_through`
unpacks them in order (the next forward does it module by module, :mod:`xscale.parallel.data.gather_hooks`, so the
transfer of later layers overlaps the forward of earlier ones, as Megatron's ``overlap_param_gather``). Every rank
starts the buckets in index order, each at the same point of its program (the step, or the first forward of the
module that unpacks the bucket before), so the collectives match across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from xscale.parallel.collectives import all_gather_flat

GATHER_WINDOW_BYTES = 64 * 2**20  # gathered bytes in flight at once (one bucket more, if it is larger)


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

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered tensor: every rank's row."""
        return self.size * self.columns * self.slots[0].full.element_size()


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

    def __init__(self, slots: list[tuple[GatherSlot, dist.ProcessGroup, int]], bucket_bytes: int,
                 window_bytes: int = GATHER_WINDOW_BYTES) -> None:
        """``slots``: each sharded parameter's slot (``column`` is set here) with its group and the group's size;
        ``window_bytes``: the most gathered bytes in flight at once (one bucket at least)."""
        self.buckets: list[_Bucket] = []
        open_buckets: dict[tuple, _Bucket] = {}
        for slot, group, size in slots:
            key = (group, slot.full.dtype, slot.full.device)
            bucket = open_buckets.get(key)
            nbytes = slot.chunk_size * size * slot.full.element_size()
            if bucket is None or (bucket.slots and bucket.nbytes + nbytes > bucket_bytes):
                bucket = _Bucket(group, size, dist.get_rank(group), [])
                open_buckets[key] = bucket
                self.buckets.append(bucket)
            slot.column = bucket.columns
            bucket.slots.append(slot)

        self.window_bytes = window_bytes
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}  # bucket index -> (gathered, its collective)
        self.started = self.unpacked = len(self.buckets)  # buckets of the last start() launched / unpacked

    def bucket_index(self) -> dict[int, int]:
        """id(slot) -> the index of the bucket that fills it."""
        return {id(slot): index for index, bucket in enumerate(self.buckets) for slot in bucket.slots}

    @torch.no_grad()
    def start(self) -> None:
        """Start the first buckets' all-gathers, ``window_bytes`` of them (asynchronous); :meth:`wait_through` or
        :meth:`finish` unpack them, each unpacked bucket starting the next ones that fit."""
        self.finish()
        self.started = self.unpacked = 0
        self._fill()

    def _fill(self) -> None:
        in_flight = sum(self.buckets[index].nbytes for index in range(self.unpacked, self.started))
        while self.started < len(self.buckets) and (
                self.started == self.unpacked or in_flight + self.buckets[self.started].nbytes <= self.window_bytes):
            bucket = self.buckets[self.started]
            in_flight += bucket.nbytes
            gathered = bucket.slots[0].full.new_empty(bucket.size, bucket.columns)
            _pack(gathered[bucket.rank], bucket.slots)
            self.pending[self.started] = gathered, all_gather_flat(gathered.view(-1), gathered[bucket.rank],
                                                                  bucket.group, async_op=True)
            self.started += 1

    @torch.no_grad()
    def wait_through(self, index: int) -> None:
        """Unpack the buckets up to ``index`` (inclusive), in order, freeing each gathered copy and starting the next
        bucket as it goes; nothing when none is in flight."""
        while self.unpacked <= index and self.unpacked < self.started:
            bucket = self.buckets[self.unpacked]
            gathered, handle = self.pending.pop(self.unpacked)
            handle.wait()
            for slot in bucket.slots:
                _unpack(gathered, slot, bucket.rank)
            del gathered  # freed before _fill allocates the next bucket's
            self.unpacked += 1
            self._fill()

    @property
    def in_flight(self) -> bool:
        return self.unpacked < len(self.buckets)

    def finish(self) -> None:
        """Unpack every bucket still in flight."""
        self.wait_through(len(self.buckets))

    def gather(self) -> None:
        """Fill every parameter with every rank's chunk, now."""
        self.start()
        self.finish()
