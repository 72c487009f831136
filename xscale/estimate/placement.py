"""Where a layout puts the model: each pp rank's blocks (the pipeline's own cost-balanced split,
:func:`xscale.parallel.pipeline.cost.stage_layers`, placed by the schedule) and which rank holds the embedding and
the head; the parameters each rank holds, stage by stage as :func:`xscale.parallel.pipeline.stages.cut_stage`
keeps them (:class:`~xscale.estimate.model_shape.OutsideBlocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from xscale.config.schema import Config
from xscale.estimate.model_shape import ModelShape, OutsideBlocks
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


def stage_parameters(shape: ModelShape, blocks: tuple[int, ...], tp: int = 1) -> tuple[int, int, int]:
    """(parameters, expert parameters, parameters whole on every tp rank) of the stage running ``blocks``
    (consecutive) under ``tp``: its blocks (under ``share_layers`` the one block of each stack it runs), and what
    :class:`~xscale.estimate.model_shape.OutsideBlocks` says a stage with those ends keeps
    (:meth:`~xscale.estimate.model_shape.ModelShape.tp_replicated` for the third)."""
    key = ("stage parameters", blocks, tp)
    if key not in shape.memo:
        replicated = shape.tp_replicated(tp)
        shape.memo[key] = (
            _stage_sum(shape, blocks, [block.held for block in shape.blocks], shape.outside_blocks,
                       shape.embedding if shape.tied else 0),
            _stage_sum(shape, blocks, [block.expert for block in shape.blocks], OutsideBlocks(), 0),
            _stage_sum(shape, blocks, replicated.blocks, replicated.outside, 0))  # a tied copy is split by vocabulary
    return shape.memo[key]


def _stage_sum(shape: ModelShape, blocks: tuple[int, ...], per_block: list[int] | tuple[int, ...],
               outside: OutsideBlocks, tied_copy: int) -> int:
    """What the stage running ``blocks`` holds of ``per_block`` and ``outside``, with ``tied_copy`` on a last stage
    that embeds nothing."""
    model = shape.model
    stacks = ((0, model.n_layers), (model.n_layers, model.total_layers)) if model.family == "encoder_decoder" else (
        (0, model.total_layers),)
    total = 0
    embeds = False
    for index, (first, stop) in enumerate(stacks):
        mine = [block for block in blocks if first <= block < stop]
        if not mine:
            continue
        total += sum(per_block[block] for block in ([first] if model.share_layers else mine))
        total += outside.anywhere[index]
        if mine[0] == first:
            total, embeds = total + outside.starts[index], True
        if mine[-1] == stop - 1:
            total += outside.ends[index]
    if embeds:
        total += outside.embedding
    if blocks and blocks[-1] == model.total_layers - 1:
        total += outside.head + (tied_copy if not embeds else 0)
    return total


def rank_parameters(shape: ModelShape, where: Placement, rank: int, tp: int = 1) -> tuple[int, int, int]:
    """(parameters, expert parameters, parameters whole on every tp rank) the pp rank holds before tp/ep sharding:
    the sum over its stages of :func:`stage_parameters` (a rank of a V or looped schedule holding the first and the
    last stage holds the embedding and the tied head's copy both, as
    :func:`xscale.estimate.memory.pipeline_rank_parameters` counts)."""
    counts = [stage_parameters(shape, blocks, tp) for blocks in where.rank_stages(rank)]
    return sum(total for total, _, _ in counts), sum(expert for _, expert, _ in counts), sum(
        replicated for _, _, replicated in counts)


def dense_parameters_per_tp_rank(counts: tuple[int, int, int], tp: int) -> float:
    """The non-expert parameters one tp rank holds of :func:`rank_parameters`' ``counts``: 1/tp of those the plan
    splits, all of those it keeps whole."""
    total, expert, replicated = counts
    return (total - expert - replicated) / tp + replicated


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
