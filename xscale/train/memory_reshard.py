"""Transformer-XL's segment memory regrouped for another layout on resume (Dai et al. 2019, sec. 3.2).

With ``data.order=streams`` row r of every global batch reads stream r, and a rank's
:class:`~xscale.models.segment_memory.SegmentMemory` names each microbatch's tensors (rows, M, D) by the
microbatch's first global row and the layer (:func:`~xscale.models.segment_memory.memory_name`). The files every
rank saved therefore hold, together, each stream's memory, whatever layout wrote them: :class:`StreamMemory` lines
them up by global row per layer (the tensor-parallel ranks of a data-parallel rank hold replicas: one is taken) and
:meth:`StreamMemory.cut` cuts them for one rank of this run's layout (its microbatches' rows, :class:`MemoryRows`).
What cannot be regrouped is refused: another ``train.global_batch_size`` (other streams), another model (layers,
width, memory lengths), rows missing (a rank's file lost).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from xscale.checkpoint.integrity import CheckpointError
from xscale.models.segment_memory import COMPRESSED, memory_name

NAME = re.compile(rf"^\((\d+), (\d+)\)({re.escape(COMPRESSED)})?$")  # memory_name's text
Part = tuple[int, bool]  # (layer, compressed): one memory of one layer, over every stream


def parse_memory_name(name: str) -> tuple[int, int, bool]:
    """(first row, layer, compressed) of a :func:`memory_name`."""
    match = NAME.match(name)
    if match is None:
        raise CheckpointError(f"'{name}' is not the name of a segment memory tensor (expected '(first_row, layer)' "
                              f"or '(first_row, layer){COMPRESSED}'); the memory file was not written by xscale")
    return int(match[1]), int(match[2]), match[3] is not None


@dataclass(frozen=True)
class MemoryRows:
    """The global batch rows a rank's memory holds: ``rows`` rows from each of ``first_rows`` (one per microbatch)."""

    first_rows: tuple[int, ...]
    rows: int

    @classmethod
    def of_rank(cls, dp_rank: int, dp_size: int, local_batch_size: int, microbatches: int) -> MemoryRows:
        """Data-parallel rank ``dp_rank``'s microbatches, as :meth:`~xscale.data.GlobalSampler.shard` cuts them:
        microbatch i is global rows [dp_rank m + i dp_size m, + m), m = local_batch_size / microbatches."""
        rows = local_batch_size // microbatches
        return cls(tuple(dp_rank * rows + index * dp_size * rows for index in range(microbatches)), rows)


class StreamMemory:
    """Every stream's memory per layer, as the pieces (first row, tensor) that tile global rows [0, streams)."""

    def __init__(self, saved: list[dict[str, torch.Tensor]], streams: int) -> None:
        """``saved``: every rank's memory (``SegmentMemory.state_dict``); ``streams``: train.global_batch_size."""
        by_part: dict[Part, dict[int, torch.Tensor]] = {}
        for state in saved:
            for name, tensor in state.items():
                first_row, layer, compressed = parse_memory_name(name)
                by_part.setdefault((layer, compressed), {}).setdefault(first_row, tensor)  # a tp replica: one kept
        self.streams = streams
        self.pieces = {part: sorted(by_first_row.items()) for part, by_first_row in sorted(by_part.items())}
        for part, pieces in self.pieces.items():
            self._check_tiling(part, pieces)

    def _check_tiling(self, part: Part, pieces: list[tuple[int, torch.Tensor]]) -> None:
        what = f"the saved {'compressed ' if part[1] else ''}memory of layer {part[0]}"
        row = 0
        for first_row, tensor in pieces:
            if first_row != row:
                raise CheckpointError(f"{what} lacks global rows {row}..{first_row - 1} (or holds them twice): a "
                                      "rank's memory file is missing or damaged; resume from another checkpoint")
            if tensor.shape[1:] != pieces[0][1].shape[1:]:
                raise CheckpointError(f"{what} holds rows of shapes {list(pieces[0][1].shape[1:])} and "
                                      f"{list(tensor.shape[1:])}: the memory files are damaged")
            row += tensor.shape[0]
        if row != self.streams:
            raise CheckpointError(f"{what} holds {row} streams, this run has train.global_batch_size={self.streams}: "
                                  f"the streams differ, the memory cannot be regrouped; resume with "
                                  f"train.global_batch_size={row}")

    def rows(self, part: Part, start: int, count: int) -> torch.Tensor:
        """Global rows [start, start + count) of ``part`` (a new tensor, the saved pieces untouched)."""
        pieces = [tensor[max(start - first, 0):start + count - first] for first, tensor in self.pieces[part]
                  if first < start + count and start < first + tensor.shape[0]]
        return torch.cat(pieces)

    def check_model(self, layers: int, width: int, length: int, compressed_length: int) -> None:
        """Refuse a memory of another model: its layers, width D or lengths M differ from this run's."""
        for compressed, limit, option in ((False, length, "model.segment_memory"),
                                          (True, compressed_length, "model.compressed_memory")):
            found = sorted(layer for layer, kind in self.pieces if kind == compressed)
            if found and found != list(range(layers)):
                raise CheckpointError(f"the saved segment memory covers layers {found}, this model has "
                                      f"model.n_layers={layers}: resume with the model that wrote it")
            for layer in found:
                shape = list(self.pieces[(layer, compressed)][0][1].shape)
                if shape[2] != width or shape[1] > limit:
                    raise CheckpointError(f"the saved memory of layer {layer} has shape {shape} (rows, M, D), this "
                                          f"model keeps at most {option}={limit} states of model.d_model={width}: "
                                          "resume with the model that wrote it")

    def cut(self, rows: MemoryRows) -> dict[str, torch.Tensor]:
        """The memory of the rank holding ``rows``, named as its :class:`SegmentMemory` names it."""
        return {memory_name(first_row, layer, compressed): self.rows((layer, compressed), first_row, rows.rows)
                for layer, compressed in self.pieces for first_row in rows.first_rows}
