"""Flat-tensor all-gather and reduce-scatter under the names the installed torch prefers.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and warns on the old names (once per call site, in every rank's log); the old names are
all that torch 2.6 to 2.12 have.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | None:
    """``output`` [world x chunk's size, ...] := every rank's ``chunk``, in rank order; with ``async_op`` the
    returned work is waited on before ``output`` is read."""
    return _all_gather(output, chunk, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                        async_op: bool = False) -> dist.Work | None:
    """``output`` := this rank's slice of the sum of every rank's ``full`` (slices in rank order); with ``async_op``
    the collective runs in the background and the returned work is waited on before ``output`` is read."""
    return _reduce_scatter(output, full, group=group, async_op=async_op)
