"""Parameters that several pipeline stages hold a copy of, and the summing of their gradients.

Tied embeddings (Press & Wolf 2017) whose two ends sit on different stages become two parameters,
``embedding.weight`` on the first stage and ``output.weight`` on the last. An encoder-decoder's first decoder
stage holds ``embedding`` (and ``embedding_norm``) too, under the same names. A position encoding that biases the logits of every layer (T5's table, Raffel et al.
2020) is held by every stage running that stack's blocks, under the single-process name: ``stack.position`` by
the encoder's (or the only stack's) stages, ``decoder.position`` by the decoder's; so is a stack's one block under
``model.share_layers`` (``stack.layers.0``, ``decoder.layers.0``: ALBERT, Lan et al. 2020). Under vocabulary parallelism
(:mod:`~xscale.parallel.pipeline.vocabulary`) each vocabulary stage holds a copy of some rows of a tied embedding.
Copies start from the single-process values; after backward their gradients are summed (Megatron's embedding
group, Shoeybi et al. 2019), so the optimizer keeps them bitwise equal; the gradient norm counts each parameter
once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from xscale.models.init import canonical_name
from xscale.models.transformer import Transformer
from xscale.parallel.data import local_tensor
from xscale.parallel.pipeline.stages import TIED_SOURCE, holds_tied_copy, source_name
from xscale.parallel.pipeline.vocabulary import VocabularyShard, vocabulary_rows


@dataclass(frozen=True)
class SharedParameter:
    """A single-process parameter of which several stages hold a copy. ``find`` returns a holding stage's copies
    (two when one stage both embeds the decoder's tokens and holds the tied output); it is called at each use,
    since ZeRO-3 (``fully_shard``) replaces a module's parameters after the stages are built."""

    name: str  # the single-process name (checkpoints, the initial value)
    stages: tuple[int, ...]  # the stages holding a copy
    find: Callable[[Transformer], list[nn.Parameter]]
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # stages holding rows [start, end) only


def _embedding_copies(stage: Transformer) -> list[nn.Parameter]:
    """The stage's embedding and its tied output's own copy (a stage holding both ties them: one parameter)."""
    found = [] if stage.embedding is None else [stage.embedding.weight]
    if holds_tied_copy(stage):
        found.append(stage.output.weight)
    return found


def _norm_copies(stage: Transformer, name: str) -> list[nn.Parameter]:
    return [stage.embedding_norm.get_parameter(name)]


def _position_copies(stage: Transformer, stack: str, name: str) -> list[nn.Parameter]:
    return [getattr(stage, stack).position.get_parameter(name)]


def _named_copies(stage: Transformer, name: str) -> list[nn.Parameter]:
    """The stage's parameter whose single-process name is ``name``, wherever wrappers (activation checkpointing)
    put it."""
    return [param for path, param in stage.named_parameters() if canonical_name(path) == name]


def shared_parameters(model: Transformer, layers: list[list[int]], vocabulary_stages: int = 0,
                      stage_ranks: list[int] | None = None) -> list[SharedParameter]:
    """The parameters held by more than one of the stages cut from ``model`` (``layers``: each stage's layer
    indices, as :func:`~xscale.parallel.pipeline.stages.split_layers` gives them; the last ``vocabulary_stages``
    of them, placed on pp ranks ``stage_ranks``, hold rows of the output projection instead,
    :mod:`~xscale.parallel.pipeline.vocabulary`)."""
    config, num_stages = model.config, len(layers)
    decoder_start = [stage for stage, held in enumerate(layers) if config.n_layers in held]  # encoder-decoder
    rows = {}  # the vocabulary stages' rows of a tied embedding
    if vocabulary_stages and config.tie_embeddings:
        rows = {stage: vocabulary_rows(config.vocab_size, stage_ranks[stage], vocabulary_stages)
                for stage in range(num_stages - vocabulary_stages, num_stages)}
    embedding = {0, *decoder_start, *rows} | ({num_stages - 1} if config.tie_embeddings else set())
    candidates = [SharedParameter(TIED_SOURCE, tuple(sorted(embedding)), _embedding_copies, rows)]
    if model.embedding_norm is not None:
        candidates += [SharedParameter(f"embedding_norm.{name}", tuple(sorted({0, *decoder_start})),
                                       partial(_norm_copies, name=name))
                       for name, _ in model.embedding_norm.named_parameters()]
    stacks = [("stack", model.stack, range(config.n_layers))]
    if model.decoder is not None:
        stacks.append(("decoder", model.decoder, range(config.n_layers, config.n_layers + config.decoder_layers)))
    for stack_name, stack, indices in stacks:
        holders = tuple(stage for stage, held in enumerate(layers) if set(held) & set(indices))
        if config.share_layers:  # the stack's one block, run by every stage holding some of its depths
            candidates += [SharedParameter(f"{stack_name}.layers.0.{name}", holders,
                                           partial(_named_copies, name=f"{stack_name}.layers.0.{name}"))
                           for name, _ in stack.layers["0"].named_parameters()]
        if stack.position.adds_to_input:  # added once, by the stage embedding that stack's tokens
            continue
        candidates += [SharedParameter(f"{stack_name}.position.{name}", holders,
                                       partial(_position_copies, stack=stack_name, name=name))
                       for name, _ in stack.position.named_parameters()]
    return [entry for entry in candidates if len(entry.stages) > 1]


def shared_block_modules(stages: list[Transformer]) -> set[str]:
    """The single-process paths of every module of a shared block (``model.share_layers``) these stages hold,
    buffers-only ones included: two stages of one rank may both hold them
    (:func:`~xscale.parallel.pipeline.checkpoint.merged_view`)."""
    paths = set()
    for stage in stages:
        stacks = [stack for stack in (stage.stack, stage.decoder) if stack is not None and stack.share_layers]
        shared = {id(module) for stack in stacks for module in stack.layers["0"].modules()}
        paths |= {canonical_name(f"{path}.").rstrip(".") for path, module in stage.named_modules()
                  if id(module) in shared}
    return paths


class SharedParameterGrads:
    """Sums the gradients of every copy of each shared parameter, so the optimizer keeps the copies bitwise equal.

    This rank first adds up its own copies (two stages of an interleaved or V schedule may both hold one, and a
    stage may hold two); the pp ranks holding copies then swap these sums point-to-point (no extra process group)
    and each adds them in ascending pp rank order, so every copy gets bitwise the same gradient. Gradients from
    earlier steps (accumulation) are set aside by :meth:`begin` and added back by :meth:`finish`, so only this
    step's are exchanged.

    Whole copies are sharded alike on every stage: vocabulary rows of the embedding or a Replicate table under tp,
    FSDP2 rows under ZeRO-3, whose gradients are then already summed over data parallel. The peers across the
    pipeline sit at the same tp and data-parallel coordinates, so they hold the same rows and swap their local
    shards. Row copies (a tied embedding's rows on the vocabulary stages, ``SharedParameter.rows``) are summed in
    :meth:`_finish_rows`.
    """

    def __init__(self, stages: list[Transformer], stage_indices: list[int], stage_ranks: list[int],
                 shared: list[SharedParameter], group: dist.ProcessGroup) -> None:
        self.stages, self.stage_indices, self.stage_ranks, self.group = stages, stage_indices, stage_ranks, group
        self.shared = [entry for entry in shared if len(set(entry.stages)) > 1]
        self.ranks = {entry.name: sorted({stage_ranks[index] for index in entry.stages}) for entry in self.shared}
        self._earlier: dict[int, torch.Tensor | None] = {}

    def copies(self, entry: SharedParameter) -> list[nn.Parameter]:
        """This rank's copies of ``entry``, in stage order."""
        found = [param for stage, index in zip(self.stages, self.stage_indices) if index in entry.stages
                 for param in entry.find(stage)]
        return list({id(param): param for param in found}.values())

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The copies the gradient norm leaves out: all but the lowest stage's first, which stands for the
        parameter."""
        left_out = []
        for entry in self.shared:
            for stage, index in zip(self.stages, self.stage_indices):
                if index in entry.stages:
                    found = entry.find(stage)
                    left_out += found[1:] if index == min(entry.stages) else found
        return left_out

    def renamed_copies(self) -> dict[str, str]:
        """This rank's whole copies held under another name than the single-process one (a tied ``output.weight``;
        canonical names) -> that name."""
        shared_ids = {id(param) for entry in self.shared for param in self.copies(entry)}
        renamed = {}
        for stage in self.stages:
            if isinstance(stage, VocabularyShard):  # rows, named in checkpoints by vocabulary_state
                continue
            for name, param in stage.named_parameters():
                name = canonical_name(name)
                if id(param) in shared_ids and source_name(stage, name) != name:
                    renamed[name] = source_name(stage, name)
        return renamed

    def begin(self) -> None:
        params = [param for entry in self.shared for param in self.copies(entry)]
        self._earlier = {id(param): param.grad for param in params}
        for param in params:
            param.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        for entry in self.shared:
            if entry.rows:
                self._finish_rows(entry)
                continue
            copies = self.copies(entry)
            if not copies:
                continue
            local = _local_grad(copies[0])
            for param in copies[1:]:
                local = local + _local_grad(param)
            total = self._sum_over_ranks(local.contiguous(), self.ranks[entry.name])
            for param in copies:
                earlier = self._earlier.get(id(param))
                summed = total.clone() if earlier is None else local_tensor(earlier) + total
                param.grad = _like_param(param, summed)
        self._earlier = {}

    def _finish_rows(self, entry: SharedParameter) -> None:
        """Sum the gradients of an entry some of whose copies hold rows only (whole tensors: a ZeRO-3 shard is
        gathered over data parallel first). The pp ranks holding a whole copy each add up, in ascending rank
        order, every whole-copy rank's sum (its row copies added at their rows) and then the row copies of the
        other ranks, so they get bitwise the same total; the lowest of them sends every other rank its rows of it.
        A gradient's traffic: the row copies once to each whole-copy rank and back, not the whole table to every
        rank."""
        me = dist.get_rank(self.group)
        held = self.held_copies(entry)
        whole_ranks = sorted({self.stage_ranks[stage] for stage in entry.stages if stage not in entry.rows})
        row_stages = [stage for stage in sorted(entry.rows) if self.stage_ranks[stage] not in whole_ranks]
        grads = {id(param): _whole_grad(param) for param, _ in held}
        ops, received = [], {}
        if me in whole_ranks:
            mine = None
            for param, rows in held:
                if rows is None:
                    mine = grads[id(param)].clone() if mine is None else mine + grads[id(param)]
            for param, rows in held:
                if rows is not None:
                    mine[rows[0]:rows[1]] += grads[id(param)]
            for peer in whole_ranks:
                if peer != me:
                    received[peer] = torch.empty_like(mine)
                    ops += [dist.P2POp(dist.isend, mine, group=self.group, group_peer=peer),
                            dist.P2POp(dist.irecv, received[peer], group=self.group, group_peer=peer)]
            for stage in row_stages:
                start, end = entry.rows[stage]
                received[stage] = mine.new_empty((end - start, *mine.shape[1:]))
                ops.append(dist.P2POp(dist.irecv, received[stage], group=self.group,
                                      group_peer=self.stage_ranks[stage]))
        else:
            for param, _ in held:
                ops += [dist.P2POp(dist.isend, grads[id(param)].contiguous(), group=self.group, group_peer=peer)
                        for peer in whole_ranks]
        _run(ops)
        ops, rows_of_total = [], {}
        if me in whole_ranks:
            total = (mine if whole_ranks[0] == me else received[whole_ranks[0]]).clone()
            for peer in whole_ranks[1:]:
                total += mine if peer == me else received[peer]
            for stage in row_stages:
                start, end = entry.rows[stage]
                total[start:end] += received[stage]
            if me == whole_ranks[0]:
                ops = [dist.P2POp(dist.isend, total[slice(*entry.rows[stage])].contiguous(), group=self.group,
                                  group_peer=self.stage_ranks[stage]) for stage in row_stages]
        else:
            for param, _ in held:
                rows_of_total[id(param)] = torch.empty_like(grads[id(param)])
                ops.append(dist.P2POp(dist.irecv, rows_of_total[id(param)], group=self.group,
                                      group_peer=whole_ranks[0]))
        _run(ops)
        for param, rows in held:
            summed = rows_of_total.get(id(param))
            if summed is None:
                summed = total if rows is None else total[rows[0]:rows[1]]
            summed = _local_part(param, summed)
            earlier = self._earlier.get(id(param))
            param.grad = _like_param(param, summed.clone() if earlier is None else local_tensor(earlier) + summed)

    def held_copies(self, entry: SharedParameter) -> list[tuple[nn.Parameter, tuple[int, int] | None]]:
        """This rank's copies of ``entry`` in stage order, each with the rows it holds (None: all of them)."""
        held, seen = [], set()
        for stage, index in zip(self.stages, self.stage_indices):
            if index in entry.stages:
                for param in entry.find(stage):
                    if id(param) not in seen:
                        seen.add(id(param))
                        held.append((param, entry.rows.get(index)))
        return held

    def _sum_over_ranks(self, local: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        """The sum of ``local`` over the pp ``ranks``, added in rank order (bitwise the same on each)."""
        me = dist.get_rank(self.group)
        if len(ranks) == 1:
            return local
        received = {peer: torch.empty_like(local) for peer in ranks if peer != me}
        ops = []
        for peer, buffer in received.items():
            ops.append(dist.P2POp(dist.isend, local, group=self.group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        parts = [local if peer == me else received[peer] for peer in ranks]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _whole_grad(param: nn.Parameter) -> torch.Tensor:
    """``param``'s whole gradient (zeros when it has none; a ZeRO-3 shard gathered over data parallel)."""
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _local_part(param: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole tensor shaped like ``param`` (its ZeRO-3 shard, cut out without communication)."""
    if isinstance(param, DTensor):
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return whole


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``'s gradient (zeros when it has none)."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with the parameter's placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local
