"""Where a layout puts the model: each pp rank's blocks (the pipeline's own cost-balanced split,
:func:`xscale.parallel.pipeline.cost.stage_layers`, placed by the schedule) and which rank holds the embedding and
the head; the parameters each rank holds."""

from __future__ import annotations

from dataclasses import dataclass

from xscale.config.schema import Config
from xscale.estimate.model_shape import ModelShape
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank
from xscale.parallel.pipeline.cost import stage_layers


@dataclass(frozen=True)
class Placement:
    """Blocks of each pp rank (its stages' blocks, in order), the rank of the first stage (embedding) and of the
    last (head)."""

    rank_blocks: tuple[tuple[int, ...], ...]
    embedding_rank: int = 0
    head_rank: int = 0


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
    return Placement(tuple(tuple(blocks) for blocks in per_rank), ranks[0], ranks[-1])


def rank_parameters(shape: ModelShape, where: Placement, rank: int) -> tuple[int, int]:
    """(parameters, expert parameters) the pp rank holds before tp/ep sharding: its blocks, the embedding on the
    first stage's rank, the final norms and the head on the last's (a tied head a copy of its own when another rank
    holds the embedding, as :func:`xscale.estimate.memory.pipeline_rank_parameters` counts)."""
    blocks = [shape.blocks[index] for index in where.rank_blocks[rank]]
    total, expert = sum(block.held for block in blocks), sum(block.expert for block in blocks)
    if rank == where.embedding_rank:
        total += shape.embedding
    if rank == where.head_rank:
        total += shape.outside
        if not shape.tied or rank != where.embedding_rank:
            total += shape.head
    return total, expert
