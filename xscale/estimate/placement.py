"""Where a layout puts the model: each pp rank's blocks (the pipeline's own cost-balanced split,
:func:`xscale.parallel.pipeline.cost.stage_layers`, placed by the schedule) and which rank holds the embedding and
the head; the parameters each rank holds, stage by stage as :func:`xscale.parallel.pipeline.stages.cut_stage`
keeps them (:class:`~xscale.estimate.model_shape.OutsideBlocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from xscale.config.schema import Config
from xscale.estimate.model_shape import ModelShape
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank
from xscale.parallel.pipeline.cost import stage_layers


@dataclass(frozen=True)
class Placement:
    """Blocks of each pp rank (its stages' blocks, in order), the rank of the first stage (embedding) and of the
    last (head); ``stages``: each stage's (rank, blocks) in stage order (empty: one stage per rank)."""

    rank_blocks: tuple[tuple[int, ...], ...]
    embedding_rank: int = 0
    head_rank: int = 0
    stages: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def rank_stages(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """The blocks of each stage that pp rank ``rank`` runs."""
        return self._stages_of_ranks[rank]

    @cached_property
    def _stages_of_ranks(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        if not self.stages:
            return tuple((blocks,) for blocks in self.rank_blocks)
        return tuple(tuple(blocks for holder, blocks in self.stages if holder == rank)
                     for rank in range(len(self.rank_blocks)))


def placement(config: Config, layers: list[list[int]] | None = None) -> Placement:
    """The placement of ``config.parallel``'s pp, stages per rank and schedule (one rank without a pipeline);
    ``layers``: each stage's blocks when already known (else the pipeline's own split)."""
    parallel = config.parallel
    if parallel.pp == 1:
        blocks = tuple(range(config.model.total_layers))
        return Placement((blocks,), 0, 0)
    num_stages = parallel.pp * parallel.pp_stages_per_rank
    layers = layers if layers is not None else stage_layers(config, num_stages)
    ranks = stage_to_rank(num_stages, parallel.pp, SCHEDULES[parallel.pp_schedule].placement)
    per_rank: list[list[int]] = [[] for _ in range(parallel.pp)]
    for stage, held in enumerate(layers):
        per_rank[ranks[stage]].extend(held)
    return Placement(tuple(tuple(blocks) for blocks in per_rank), ranks[0], ranks[-1],
                     tuple((ranks[stage], tuple(held)) for stage, held in enumerate(layers)))


def stage_parameters(shape: ModelShape, blocks: tuple[int, ...]) -> tuple[int, int]:
    """(parameters, expert parameters) of the stage running ``blocks`` (consecutive): its blocks (under
    ``share_layers`` the one block of each stack it runs), and what :class:`~xscale.estimate.model_shape.OutsideBlocks`
    says a stage with those ends keeps."""
    key = ("stage parameters", blocks)
    if key not in shape.memo:
        shape.memo[key] = _stage_parameters(shape, blocks)
    return shape.memo[key]


def _stage_parameters(shape: ModelShape, blocks: tuple[int, ...]) -> tuple[int, int]:
    model, outside = shape.model, shape.outside_blocks
    stacks = ((0, model.n_layers), (model.n_layers, model.total_layers)) if model.family == "encoder_decoder" else (
        (0, model.total_layers),)
    total = expert = 0
    embeds = False
    for index, (first, stop) in enumerate(stacks):
        mine = [block for block in blocks if first <= block < stop]
        if not mine:
            continue
        for block in ([first] if model.share_layers else mine):
            total, expert = total + shape.blocks[block].held, expert + shape.blocks[block].expert
        total += outside.anywhere[index]
        if mine[0] == first:
            total, embeds = total + outside.starts[index], True
        if mine[-1] == stop - 1:
            total += outside.ends[index]
    if embeds:
        total += outside.embedding
    if blocks and blocks[-1] == model.total_layers - 1:
        total += outside.head + (shape.embedding if shape.tied and not embeds else 0)
    return total, expert


def rank_parameters(shape: ModelShape, where: Placement, rank: int) -> tuple[int, int]:
    """(parameters, expert parameters) the pp rank holds before tp/ep sharding: the sum over its stages of
    :func:`stage_parameters` (a rank of a V or looped schedule holding the first and the last stage holds the
    embedding and the tied head's copy both, as :func:`xscale.estimate.memory.pipeline_rank_parameters` counts)."""
    counts = [stage_parameters(shape, blocks) for blocks in where.rank_stages(rank)]
    return sum(total for total, _ in counts), sum(expert for _, expert in counts)


def rank_kinds(shape: ModelShape, where: Placement) -> tuple[int, ...]:
    """The first pp rank of each kind, in rank order: ranks whose blocks have the same shapes in the same order,
    that hold the same parameters and the same ends (rank 0's embedding, the head) have the same step-time terms
    (:func:`xscale.estimate.step_time.step_time` compares these only)."""
    first: dict[tuple, int] = {}
    for rank, blocks in enumerate(where.rank_blocks):
        kind = (shape.distinct_blocks(blocks), len(blocks), rank == 0, rank == where.head_rank,
                rank_parameters(shape, where, rank))
        first.setdefault(kind, rank)
    return tuple(first.values())
