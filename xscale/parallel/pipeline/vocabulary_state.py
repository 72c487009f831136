"""Vocabulary stages in checkpoints: each pp rank's rows shown as one [V, ...] tensor sharded over the pp ranks.

Under ``parallel.pp_vocab_parallel`` the vocabulary stage of pp rank r holds rows V_r (torch.chunk's split,
:func:`~xscale.parallel.pipeline.vocabulary.vocabulary_rows`) of the output projection, ``output.weight`` and
``output.bias``, and of their optimizer moments. Saved as they are, DCP would see p different tensors under one name.
:meth:`VocabularyRows.globalize` wraps each as a DTensor sharded on dim 0 over the pp mesh with the global shape
[V, ...], so DCP writes the p pieces as one tensor under the single-process name and reads it back into any layout,
and the checkpoint's shape fingerprint is the single-process one (:mod:`xscale.parallel.expert.state` does the same
for experts over ep). Under ZeRO-3 the rows are themselves sharded over data parallel: gathered first, and cut back
to this rank's shard by :meth:`VocabularyRows.localize` after loading.

A tied projection's rows copy the embedding's (:mod:`~xscale.parallel.pipeline.shared` keeps them equal); one
process keeps their optimizer moments under ``embedding.weight``. So checkpoints show ``state.embedding.weight.*`` on
every pp rank as its vocabulary stage's rows, which cover the table once, and after loading a rank that also holds the
whole embedding receives the other ranks' rows of each moment.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.parallel.pipeline.checkpoint import names_param, renamed_key
from xscale.parallel.pipeline.stages import TIED_SOURCE
from xscale.parallel.pipeline.vocabulary import VocabularyShard, vocabulary_rows
from xscale.parallel.row_pieces import as_held, as_piece, piece_rows

StateDict = dict[str, Any]


class VocabularyRows:
    """The checkpoint view of this pp rank's vocabulary stage ``shard`` (module docstring). ``embedding``: returns
    this rank's whole embedding table when it holds one (else None), looked up at each use since ZeRO-3 replaces
    parameters after the stages are built; ``whole_ranks``: the pp ranks holding one. pp rank r holds the r-th rows
    (:class:`~xscale.parallel.pipeline.vocabulary.VocabularyPlace`), as the pp mesh's Shard(0) places them."""

    def __init__(self, shard: VocabularyShard, mesh: DeviceMesh, embedding, whole_ranks: list[int]) -> None:
        self.shard, self.mesh, self.embedding = shard, mesh, embedding
        self.vocab_size = shard.config.vocab_size
        self.tied = shard.config.tie_embeddings
        self.whole_ranks = whole_ranks

    def _params(self) -> dict[str, nn.Parameter]:
        return {f"output.{name}": param for name, param in self.shard.output.named_parameters()}

    def _saved_name(self, name: str) -> str:
        return TIED_SOURCE if self.tied and name == "output.weight" else name

    def globalize(self, state: StateDict) -> StateDict:
        """A {"model", "optimizer"} state (single-process names, DCP's flattened optimizer keys) with this rank's
        rows as pieces of the [V, ...] tensors; a tied projection's optimizer entries under ``embedding.weight``
        (a rank holding the whole embedding drops the table's own: equal to the rows on the pp ranks)."""
        model, optimizer = dict(state["model"]), dict(state["optimizer"])
        for name in self._params():
            model[name] = as_piece(model[name], self.mesh, self.vocab_size)
        if self.tied and self.embedding() is not None:
            for key in [key for key in optimizer if names_param(key, TIED_SOURCE)]:
                del optimizer[key]
        for name in self._params():
            for key in [key for key in optimizer if names_param(key, name)]:
                value = optimizer.pop(key)
                optimizer[renamed_key(key, name, self._saved_name(name))] = (
                    as_piece(value, self.mesh, self.vocab_size) if _is_moment(key, value) else value)
        return {**state, "model": model, "optimizer": optimizer}

    def localize(self, state: StateDict) -> StateDict:
        """The inverse of :meth:`globalize` after a load: each tensor in this rank's parameter's form (its rows, or
        a ZeRO-3 shard of them); a whole embedding's moments rebuilt from every pp rank's rows."""
        model, optimizer = dict(state["model"]), dict(state["optimizer"])
        params = self._params()
        for name, param in params.items():
            model[name] = as_held(model[name], param)
        embedding = self.embedding() if self.tied else None
        for name, param in params.items():
            saved = self._saved_name(name)
            for key in sorted(key for key in optimizer if names_param(key, saved)):
                value = optimizer[key]
                local_key = renamed_key(key, saved, name)
                if _is_moment(key, value):
                    rows = piece_rows(value)
                    optimizer[local_key] = as_held(rows, param)
                    if saved != name:  # every pp rank sends its rows to the whole-embedding ranks
                        whole = self._gather_rows(rows)
                        if embedding is not None:
                            optimizer[key] = as_held(whole, embedding)
                else:
                    optimizer[local_key] = value.clone() if isinstance(value, torch.Tensor) else value
                if saved != name and embedding is None:
                    del optimizer[key]
        return {**state, "model": model, "optimizer": optimizer}

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The whole [V, ...] tensor on the whole-embedding ranks, from every pp rank's rows (None elsewhere)."""
        group = self.mesh.get_group()
        me = dist.get_rank(group)
        ops = [dist.P2POp(dist.isend, rows.contiguous(), group=group, group_peer=rank)
               for rank in self.whole_ranks if rank != me]
        whole = None
        if me in self.whole_ranks:
            whole = rows.new_empty((self.vocab_size, *rows.shape[1:]))
            for rank in range(self.mesh.size()):
                start, end = vocabulary_rows(self.vocab_size, rank, self.mesh.size())
                if rank == me:
                    whole[start:end] = rows
                else:
                    ops.append(dist.P2POp(dist.irecv, whole[start:end], group=group, group_peer=rank))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return whole


def _is_moment(key: str, value: Any) -> bool:
    return key.startswith("state.") and isinstance(value, torch.Tensor) and value.ndim > 0

