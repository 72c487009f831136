"""Flat-tensor all-gather and reduce-scatter under the names the installed torch prefers, and on gloo by direct
transfers.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and warns on the old names (once per call site, in every rank's log); the old names are
all that torch 2.6 to 2.12 have.

On CPU tensors over gloo the two go another way, because gloo's own are the slower way there. Measured by
``xscale bench collectives`` (2 ranks of a 2-core machine, 25 MB): all-gather 27 ms, one broadcast from each rank
17 ms; reduce-scatter 46 ms (more than the 28 ms all-reduce of the whole), each rank sending every other its slice
22 ms (``tests/parallel/test_collectives.py`` checks the results). So the all-gather is a broadcast from each rank
into its row, and the reduce-scatter sends each rank's slice to its owner (``isend`` / ``irecv``) and adds what
arrives. ``XSCALE_GLOO_DIRECT=0`` keeps torch's collectives.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


GLOO_DIRECT = os.environ.get("XSCALE_GLOO_DIRECT", "1") != "0"  # read once, at import
# Every rank of a group calls these in the same order, so the n-th call's tag is the same on every rank of it.
_tags: dict[object, itertools.count] = {}


class DirectWork(dist.Work):
    """The pending transfers of one direct collective: :meth:`wait` waits on them, then runs ``finish`` (which holds
    the buffers it reads, so they live until then). A ``dist.Work``, so code that waits only on ``Work`` objects
    (FSDP2's custom collectives) waits on it."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.works, self.finish = works, finish

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
        self.works, self.finish = [], None
        return True

    def is_completed(self) -> bool:
        return self.finish is None and not self.works


def _direct(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    return GLOO_DIRECT and tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _done(work: DirectWork, async_op: bool) -> DirectWork | None:
    if async_op:
        return work
    work.wait()
    return None


def direct_all_gather(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> DirectWork | None:
    """All-gather as one broadcast from each rank into its row of ``output`` (``chunk`` may be that row already)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = output.view(size, -1)
    if chunk.data_ptr() != rows[rank].data_ptr():
        rows[rank].copy_(chunk.reshape(-1))
    works = [dist.broadcast(rows[source], _global(group, source), group=group, async_op=True)
             for source in range(size)]
    return _done(DirectWork(works), async_op)


def direct_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> DirectWork | None:
    """Reduce-scatter as each rank sending every other rank its slice and summing the slices it receives (own slice
    first, then from rank - 1, rank - 2, ...: a fixed order)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = full.reshape(size, -1)
    received = full.new_empty(max(size - 1, 0), slices.shape[1])
    key = group if group is not None else dist.group.WORLD  # one counter for the world however it is named
    tag = next(_tags.setdefault(key, itertools.count())) % (1 << 20)
    works = []
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(slices[to], _global(group, to), group=group, tag=tag))
        works.append(dist.irecv(received[step - 1], _global(group, source), group=group, tag=tag))

    def finish() -> None:
        total = output.view(-1)
        if size == 1:
            total.copy_(slices[rank])
            return
        torch.add(slices[rank], received[0], out=total)  # one pass for the first sum, not a copy and an add
        for piece in received[1:]:
            total.add_(piece)

    return _done(DirectWork(works, finish), async_op)


def all_gather_flat(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | DirectWork | None:
    """``output`` [world x chunk's size, ...] := every rank's ``chunk``, in rank order (``chunk`` may be this rank's
    row of ``output``: in place, as NCCL allows); with ``async_op`` the returned work is waited on before ``output``
    is read."""
    if _direct(group, output):
        return direct_all_gather(output, chunk, group, async_op)
    return torch_all_gather(output, chunk, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                        async_op: bool = False) -> dist.Work | DirectWork | None:
    """``output`` := this rank's slice of the sum of every rank's ``full`` (slices in rank order); with ``async_op``
    the collective runs in the background and the returned work is waited on before ``output`` is read."""
    if _direct(group, output):
        return direct_reduce_scatter(output, full, group, async_op)
    return torch_reduce_scatter(output, full, group=group, async_op=async_op)
