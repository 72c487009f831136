"""A rank's rows of a tensor in checkpoints: shown as its piece of the whole tensor, and taken back after a load.

Experts over ep (:mod:`xscale.parallel.expert.state`) and the vocabulary stages' rows over pp
(:mod:`xscale.parallel.pipeline.vocabulary_state`) hold a block of rows of a single-process tensor under its name.
:func:`as_piece` wraps the block as a DTensor sharded on dim 0 over the mesh (torch.chunk's split: mesh rank r holds
the r-th rows), so DCP writes the pieces as one tensor and reads it back into any layout; :func:`as_held` turns a
loaded piece back into what the rank's parameter holds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def as_piece(rows: torch.Tensor, mesh: DeviceMesh, total_rows: int | None = None) -> DTensor:
    """This rank's ``rows`` (a ZeRO-3 or tp shard of them gathered first) as its piece of the tensor of
    ``total_rows`` rows (default: as many per mesh rank), sharded on dim 0 over ``mesh``; a view without ZeRO-3."""
    if isinstance(rows, DTensor):
        rows = rows.full_tensor()
    total_rows = rows.shape[0] * mesh.size() if total_rows is None else total_rows
    shape = torch.Size((total_rows, *rows.shape[1:]))
    return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def piece_rows(value: torch.Tensor) -> torch.Tensor:
    """The rows of a loaded piece (:func:`as_piece`), or a plain tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def as_held(value: torch.Tensor, like: nn.Parameter) -> torch.Tensor:
    """A loaded piece in the form ``like`` holds it: its rows, or this rank's ZeRO-3 / tp shard of them."""
    rows = piece_rows(value)
    if isinstance(like, DTensor):
        return distribute_tensor(rows, like.device_mesh, like.placements, src_data_rank=None)
    return rows
