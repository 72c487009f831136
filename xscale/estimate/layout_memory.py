"""A candidate layout's peak bytes per rank, from :mod:`~xscale.estimate.memory`'s terms, without building a model
per layout (the fake-tensor measure is for one chosen layout: ``xscale inspect --measure``).

Activations per block and microbatch: :func:`~xscale.estimate.activations.block_activation_bytes`; under full
recomputation one block's whole activations besides, while it is rebuilt. The single-device fused loss computes
its gradient in the forward and frees its logits chunk before the backward starts, so that chunk and the rebuilt
block are never alive together: the larger of the two counts (under tp the vocabulary-parallel loss keeps its
softmax for the backward: both count). A rank's share of them is
:func:`~xscale.estimate.memory.activation_share` (tp, sequence parallelism, cp); the microbatches it holds come from
the schedule (:func:`xscale.estimate.in_flight.blocks_in_flight`). Beside them, what the layout's transfers hold:
the pipeline's receive buffers and what it has sent (:func:`~xscale.estimate.memory.pipeline_buffer_bytes`,
:func:`~xscale.estimate.memory.pipeline_send_bytes`) and, on a rank running MoE layers under ep, one layer's
all-to-all buffers (:func:`~xscale.estimate.memory.expert_exchange_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xscale.config.schema import Config
from xscale.estimate.activations import block_activation_bytes
from xscale.estimate.layout import Layout
from xscale.estimate.memory import (
    PeakTerms,
    UnitSizes,
    activation_share,
    all_gather_bytes,
    expert_exchange_bytes,
    fused_loss_chunk_bytes,
    pipeline_buffer_bytes,
    pipeline_send_bytes,
    predicted_state_bytes,
    vocab_parallel_loss_bytes,
)
from xscale.estimate.model_shape import ModelShape
from xscale.estimate.placement import Placement, rank_parameters
from xscale.parallel.dims import ParallelDims
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank


@dataclass(frozen=True)
class _LayoutTerms:
    """What every pp rank's peak of one layout shares: its dims, those of one stage's state, the activation share,
    each stage's rank and the tokens of a microbatch."""

    dims: ParallelDims
    stage_dims: ParallelDims
    share: float
    stage_ranks: list[int]
    tokens: int


def _layout_terms(shape: ModelShape, config: Config, layout: Layout) -> _LayoutTerms:
    dims = layout.dims()
    num_stages = layout.pp * layout.stages_per_rank
    return _LayoutTerms(dims, dataclasses.replace(dims, pp=1), activation_share(config, dims),
                        stage_to_rank(num_stages, layout.pp, SCHEDULES[layout.schedule].placement),
                        layout.micro_batch * shape.seq_len // layout.cp)


def rank_peak(shape: ModelShape, config: Config, layout: Layout, where: Placement, rank: int,
              held_microbatch_blocks: float) -> PeakTerms:
    """The :class:`PeakTerms` of pp rank ``rank``; ``config`` is the layout applied (:meth:`Layout.apply`),
    ``held_microbatch_blocks`` the (block, microbatch) activations it holds at once."""
    return _rank_peak(shape, config, layout, where, rank, held_microbatch_blocks, _layout_terms(shape, config, layout))


def _rank_peak(shape: ModelShape, config: Config, layout: Layout, where: Placement, rank: int,
               held_microbatch_blocks: float, terms: _LayoutTerms) -> PeakTerms:
    dims, share, tokens = terms.dims, terms.share, terms.tokens
    total, expert, replicated = rank_parameters(shape, where, rank, layout.tp)
    state = predicted_state_bytes(total, terms.stage_dims, expert, replicated)
    blocks = where.rank_blocks[rank]
    distinct = shape.distinct_blocks(blocks)
    mean_block = (sum(count * block_activation_bytes(shape, block, layout.micro_batch, layout.checkpointing)
                      for block, count in distinct) / len(blocks)) if blocks else 0.0
    activations = held_microbatch_blocks * mean_block * share
    rebuilt = 0.0
    if layout.checkpointing == "full" and blocks:  # one block rebuilt whole during its backward
        rebuilt = share * max(block_activation_bytes(shape, block, layout.micro_batch, "none")
                              for block, _ in distinct)
    loss = 0.0
    if rank == where.head_rank:
        loss = (vocab_parallel_loss_bytes(config, dims, tokens) if layout.tp > 1
                else fused_loss_chunk_bytes(config, tokens))
    if layout.tp > 1:
        activations += rebuilt
    else:  # the fused loss's chunk is gone before a block is rebuilt (module docstring)
        loss = max(loss, rebuilt)
    # whole on every tp rank: what the plan replicates, with the experts of a (replicated) MoE layer
    replicated_blocks = [shape.tp_replicated(layout.tp).blocks[index] + (shape.blocks[index].expert if layout.tp > 1
                                                                         else 0) for index in blocks]
    sizes = UnitSizes(total - sum(shape.blocks[index].held for index in blocks),
                      [shape.blocks[index].held for index in blocks], shape.largest_parameter,
                      replicated - sum(replicated_blocks), replicated_blocks)
    stages = [stage for stage, holder in enumerate(terms.stage_ranks) if holder == rank]
    return PeakTerms(parameters=state["parameters"], gradients=state["gradients"], optimizer=state["optimizer"],
                     activations=activations, all_gather=all_gather_bytes(config, dims, sizes),
                     vocab_parallel_loss=loss,
                     pipeline_buffers=(pipeline_buffer_bytes(config, dims, tokens, stages)
                                       + pipeline_send_bytes(config, dims, tokens, stages)),
                     expert_exchange=expert_exchange_bytes(config, dims, tokens,
                                                           sum(count for block, count in distinct if block.moe)))


def peak_bytes(shape: ModelShape, config: Config, layout: Layout, where: Placement,
               held_microbatch_blocks: list[float]) -> float:
    """The largest predicted peak over the pp ranks (every rank of one pp stage holds the same)."""
    terms = _layout_terms(shape, config, layout)
    return max(_rank_peak(shape, config, layout, where, rank, held_microbatch_blocks[rank], terms).peak
               for rank in range(layout.pp))
