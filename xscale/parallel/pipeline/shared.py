"""Parameters that several pipeline stages hold a copy of, and the summing of their gradients.

Tied embeddings (Press & Wolf 2017) whose two ends sit on different stages become two parameters,
``embedding.weight`` on the first stage and ``output.weight`` on the last. An encoder-decoder's first decoder
stage holds ``embedding`` (and ``embedding_norm``) too, under the same names. A position encoding that biases the logits of every layer (T5's table, Raffel et al.
2020) is held by every stage running that stack's blocks, under the single-process name: ``stack.position`` by
the encoder's (or the only stack's) stages, ``decoder.position`` by the decoder's; so is a stack's one block under
``model.share_layers`` (``stack.layers.0``, ``decoder.layers.0``: ALBERT, Lan et al. 2020), and the output projection
by every vocabulary stage (:mod:`~xscale.parallel.pipeline.vocabulary`). Copies start from the
single-process values; after backward their gradients are summed (Megatron's embedding group, Shoeybi et al.
2019), so the optimizer keeps them bitwise equal; the gradient norm counts each parameter once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.models.init import canonical_name
from xscale.models.transformer import Transformer
from xscale.parallel.data import local_tensor
from xscale.parallel.pipeline.stages import TIED_SOURCE, holds_tied_copy, source_name


@dataclass(frozen=True)
class SharedParameter:
    """A single-process parameter of which several stages hold a copy. ``find`` returns a holding stage's copies
    (two when one stage both embeds the decoder's tokens and holds the tied output); it is called at each use,
    since ZeRO-3 (``fully_shard``) replaces a module's parameters after the stages are built."""

    name: str  # the single-process name (checkpoints, the initial value)
    stages: tuple[int, ...]  # the stages holding a copy
    find: Callable[[Transformer], list[nn.Parameter]]


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


def shared_parameters(model: Transformer, layers: list[list[int]], vocabulary_stages: int = 0) -> list[SharedParameter]:
    """The parameters held by more than one of the stages cut from ``model`` (``layers``: each stage's layer
    indices, as :func:`~xscale.parallel.pipeline.stages.split_layers` gives them; the last ``vocabulary_stages``
    of them hold the output projection instead, :mod:`~xscale.parallel.pipeline.vocabulary`)."""
    config, num_stages = model.config, len(layers)
    decoder_start = [stage for stage, held in enumerate(layers) if config.n_layers in held]  # encoder-decoder
    output_stages = set(range(num_stages - max(vocabulary_stages, 1), num_stages))
    embedding = {0, *decoder_start} | (output_stages if config.tie_embeddings else set())
    candidates = [SharedParameter(TIED_SOURCE, tuple(sorted(embedding)), _embedding_copies)]
    if model.output is not None:  # the vocabulary stages' copies of the projection (all of it when untied)
        candidates += [SharedParameter(f"output.{name}", tuple(sorted(output_stages)),
                                       partial(_named_copies, name=f"output.{name}"))
                       for name, _ in model.output.named_parameters()
                       if not (name == "weight" and config.tie_embeddings)]
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
        if stage.config.share_layers:
            for path, _ in stage.named_modules():
                path = canonical_name(f"{path}.").rstrip(".")
                if path.startswith(("stack.layers.0.", "decoder.layers.0.")) or path in ("stack.layers.0",
                                                                                          "decoder.layers.0"):
                    paths.add(path)
    return paths


class SharedParameterGrads:
    """Sums the gradients of every copy of each shared parameter, so the optimizer keeps the copies bitwise equal.

    This rank first adds up its own copies (two stages of an interleaved or V schedule may both hold one, and a
    stage may hold two); the pp ranks holding copies then swap these sums point-to-point (no extra process group)
    and each adds them in ascending pp rank order, so every copy gets bitwise the same gradient. Gradients from
    earlier steps (accumulation) are set aside by :meth:`begin` and added back by :meth:`finish`, so only this
    step's are exchanged.

    Copies are sharded alike on every stage: vocabulary rows of the embedding or a Replicate table under tp,
    FSDP2 rows under ZeRO-3, whose gradients are then already summed over data parallel. The peers across the
    pipeline sit at the same tp and data-parallel coordinates, so they hold the same rows and swap their local
    shards.
    """

    def __init__(self, stages: list[Transformer], stage_indices: list[int], stage_ranks: list[int],
                 shared: list[SharedParameter], group: dist.ProcessGroup) -> None:
        self.stages, self.stage_indices, self.group = stages, stage_indices, group
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
        """This rank's copies held under another name than the single-process one (a tied ``output.weight``;
        canonical names) -> that name."""
        shared_ids = {id(param) for entry in self.shared for param in self.copies(entry)}
        renamed = {}
        for stage in self.stages:
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


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``'s gradient (zeros when it has none)."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with the parameter's placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local
