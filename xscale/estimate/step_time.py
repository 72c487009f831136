"""A training step's time under one layout: compute, the pipeline bubble, the communication left exposed, and the
optimizer step (docs/planning.md derives and bounds each term).

Compute, per microbatch of ``b`` sequences on one rank (tokens t = b T / cp), from :mod:`~xscale.estimate.model_shape`'s
FLOPs, each GEMM at ``peak x efficiency(smallest dimension)`` (:class:`~xscale.estimate.cluster.Cluster`):
dense weights 2 t used / tp (smallest dimension min(t, d / tp)), experts 2 t used_E (replicated over tp; rows per
expert t ep share), attention 4 t keys d / tp (at the cluster's attention efficiency for head_dim and keys,
:meth:`~xscale.estimate.cluster.Cluster.attention_fraction`), the head 2 t d V / tp. Backward is twice
the forward (Kaplan et al. 2020); full recomputation adds the blocks' forward, selective their attention cores'.
Beside the GEMMs (:mod:`~xscale.estimate.overheads`): the memory-bound ops move each block's stored activations
(:func:`~xscale.estimate.activations.block_activation_bytes`, the rank's share) once in the forward and twice in the
backward at the calibrated elementwise bandwidth, the loss does its softmax work per logit (V / tp per token), and
each block pays a fixed dispatch cost per microbatch, the step one per step (``StepTime.overhead``).
The slowest pp rank sets the pace: compute = m x t_mb (m microbatches per step).

Bubble (Narayanan et al. 2021, sec. 2.2): (pp - 1) t_mb for GPipe and 1F1B ((p-1)/(m+p-1) of the step), divided by
v stages per rank for interleaved 1F1B; ZB-V (Qi et al. 2024, sec. 6): (pp - 1) max(0, T_F + T_B - 2 T_W) per
stage, with T_B (input half) = T_W (weight half) = T_F, so zero unless recomputation lengthens T_B.

Communication per step (alpha-beta times, :mod:`~xscale.estimate.communication`; activations in the compute dtype):
* tp: per block and microbatch 2 all-reduces of t d forward and 2 backward (+2 for a cross-attention, 1 fewer for a
  MoE layer whose experts are replicated over tp; reduce-scatter + all-gather under sequence parallelism, the same
  bytes); full recomputation repeats the forward's. Under sequence parallelism each norm's weight gradient (d
  values) is all-reduced in the backward: 2 per block (3 with a cross-attention). The vocabulary-parallel loss
  all-reduces 3 values per token forward (max, sum of exponentials, target logit) and the embedding's output
  (t d) once forward and once backward. Costed with the cluster's tensor-parallel figures
  (:func:`~xscale.estimate.communication.tensor_parallel_seconds`). Exposed: nothing overlaps them.
* cp: per block an all-gather of K and V (2 b T kv_heads head_dim / tp) forward, a reduce-scatter of their
  gradients backward (Llama 3's all-gather attention); exposed.
* ep: per MoE block 2 all-to-alls (dispatch, combine) of t k c d per rank (k experts per token, c the capacity
  factor) forward, 2 backward (+2 recomputed); exposed.
* pp: each stage receives t d (/ tp under sp) forward and its gradient backward: 2 m v receives on the slowest rank,
  exposed.
* dp: gradients (fp32) all-reduced (DDP) or reduce-scattered (ZeRO-1/2/3) in ``bucket_mb`` buckets during the last
  microbatch's backward: exposed max(t_reduce - backward of one microbatch, one bucket). ZeRO-1/2 all-gather the
  updated fp32 parameters during the next forward: exposed max(t_gather - forward of one microbatch, one bucket).
  ZeRO-3 all-gathers the compute-dtype parameters block by block with the next one prefetched, each forward and
  backward of each microbatch (once per step under a pipeline, whose stages stay gathered): exposed max(t_gather -
  that pass's compute, one block's gather). Expert weights travel over the ranks that share them (dp / ep x cp).
  On a CPU node whose cores the processes fill nothing overlaps (:func:`overlaps_compute`: gloo's threads need
  the cores): the whole dp time is exposed.

Optimizer (memory-bound): 28 bytes per parameter the rank updates (reads fp32 weight, gradient and two moments,
writes weight and moments) over the memory bandwidth.

Processes that share a node's cores (more processes than ``concurrent_devices``) each get
:meth:`~xscale.estimate.cluster.Cluster.compute_share` s of the peak FLOP/s and of the memory bandwidth; a rank
idle in its pipeline bubble lends its core to the others, so compute C and bubble B (both at the shared rate) take
max(C, s (C + B)): the node's whole work over its cores, or one rank's path at full rate
(:func:`shared_bubble_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from xscale.estimate.activations import block_activation_bytes
from xscale.estimate.cluster import Cluster
from xscale.estimate.communication import collective_seconds, tensor_parallel_seconds
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import ModelShape
from xscale.estimate.overheads import (
    block_dispatch_forward_seconds,
    elementwise_forward_seconds,
    loss_forward_seconds,
    step_dispatch_seconds,
)
from xscale.estimate.placement import Placement, dense_parameters_per_tp_rank, rank_parameters

GRADIENT_BYTES = 4  # fp32 gradients and weights (fp32 master weights under bf16 autocast)
OPTIMIZER_BYTES_PER_PARAMETER = 28  # read weight, gradient, 2 moments (16); write weight, 2 moments (12)
LOSS_REDUCED_PER_TOKEN = 3  # vocabulary-parallel cross-entropy: max, sum of exponentials, target logit


@dataclass
class StepTime:
    """Seconds of one step: ``compute`` (all microbatches on the slowest rank), ``bubble``, exposed
    ``communication`` per dimension, ``optimizer``, and the step's fixed dispatch ``overhead``."""

    compute: float
    bubble: float
    optimizer: float
    communication: dict[str, float] = field(default_factory=dict)
    overhead: float = 0.0

    @property
    def exposed_communication(self) -> float:
        return sum(self.communication.values())

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed_communication + self.optimizer + self.overhead


@dataclass(frozen=True)
class MicrobatchTimes:
    """One microbatch on one rank: forward of the blocks, of their attention cores, and of the embedding/head."""

    blocks: float
    attention: float
    head: float

    def forward(self) -> float:
        return self.blocks + self.head

    def recompute(self, checkpointing: str) -> float:
        return {"none": 0.0, "selective": self.attention, "full": self.blocks}[checkpointing]


def value_bytes(shape: ModelShape) -> int:
    return 2 if shape.config.train.low_precision else 4


def microbatch_times(shape: ModelShape, cluster: Cluster, layout: Layout, blocks: tuple[int, ...],
                     holds_head: bool) -> MicrobatchTimes:
    """Forward seconds of one microbatch through ``blocks`` (and the head) on one rank (module docstring)."""
    model = shape.model
    share = cluster.compute_share(layout.world_size)  # processes that share a CPU node's cores
    peak = share * cluster.peak_flops["bf16" if shape.config.train.low_precision else "fp32"]
    tokens = layout.micro_batch * shape.seq_len / layout.cp
    dense_rate = peak * cluster.efficiency(min(tokens, model.d_model / layout.tp))
    expert_rows = tokens * layout.ep * shape.expert_share
    expert_rate = peak * cluster.efficiency(min(expert_rows, model.d_model))
    gemms = attention = 0.0
    stored = tokens / (layout.micro_batch * shape.seq_len) / (layout.tp if layout.sequence_parallel else 1)
    for block, count in shape.distinct_blocks(blocks):
        moved = block_activation_bytes(shape, block, layout.micro_batch, "none") * stored
        gemm = (elementwise_forward_seconds(cluster, moved) + block_dispatch_forward_seconds(cluster)) / share
        gemm += 2 * tokens * (block.used - block.expert_used) / layout.tp / dense_rate
        gemm += 2 * tokens * block.expert_used / expert_rate if block.expert_used else 0.0
        keys = block.keys + block.cross_keys
        gemms += count * gemm
        attention += count * 4 * tokens * keys * model.d_model / layout.tp / (
            peak * cluster.attention_fraction(model.head_dim, keys))
    head = 0.0
    if holds_head:
        head = (2 * tokens * (shape.head + shape.outside) / layout.tp / dense_rate
                + loss_forward_seconds(cluster, tokens, shape.head / model.d_model / layout.tp) / share)
    return MicrobatchTimes(gemms + attention, attention, head)


def bubble_seconds(layout: Layout, times: MicrobatchTimes) -> float:
    """The pipeline's idle time per step (module docstring); ``times``: the slowest rank's microbatch."""
    if layout.pp == 1:
        return 0.0
    forward = times.forward()
    recompute = times.recompute(layout.checkpointing)
    if layout.schedule == "zero_bubble":  # per stage: T_F = T_W = forward / v, T_B = (forward + recompute) / v
        per_stage = recompute / layout.stages_per_rank
        return (layout.pp - 1) * max(0.0, per_stage)
    step = 3 * forward + recompute
    return (layout.pp - 1) * step / (layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1)


def shared_bubble_seconds(compute: float, bubble: float, share: float) -> float:
    """The bubble left once idle ranks lend their cores to the node's other processes: max(0, s (C + B) - C)
    (module docstring); B itself when every process has a core (s = 1)."""
    return max(0.0, share * (compute + bubble) - compute)


def _tp_seconds(shape: ModelShape, cluster: Cluster, layout: Layout, blocks: tuple[int, ...],
                holds_ends: tuple[bool, bool]) -> float:
    """Tensor parallelism's time per step on one pp rank (module docstring); ``holds_ends``: (embedding, head)."""
    if layout.tp == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq_len / layout.cp
    size = tokens * shape.model.d_model * value_bytes(shape)
    per_forward = sum(2 - shape.blocks[index].moe + (2 if shape.blocks[index].cross_keys else 0) for index in blocks)
    passes = 2 + (1 if layout.checkpointing == "full" else 0)  # forward, backward (same count), recomputed forward
    collective = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
    one = tensor_parallel_seconds(cluster, collective, layout.tp, size)
    if layout.sequence_parallel:  # each all-reduce becomes a reduce-scatter and an all-gather
        one += tensor_parallel_seconds(cluster, "all_gather", layout.tp, size)
    seconds = passes * per_forward * one
    if layout.sequence_parallel:  # the norms' weight gradients, all-reduced in the backward
        norms = sum(2 + (1 if shape.blocks[index].cross_keys else 0) for index in blocks)
        seconds += tensor_parallel_seconds(cluster, "all_reduce", layout.tp,
                                           norms * shape.model.d_model * GRADIENT_BYTES, calls=norms)
    embedding, head = holds_ends
    if embedding:  # the vocabulary-parallel embedding's output, forward and backward
        seconds += 2 * tensor_parallel_seconds(cluster, collective, layout.tp, size)
    if head:  # the vocabulary-parallel loss's per-token reductions
        seconds += tensor_parallel_seconds(cluster, "all_reduce", layout.tp, LOSS_REDUCED_PER_TOKEN * tokens * 4,
                                           calls=LOSS_REDUCED_PER_TOKEN)
    return layout.microbatches * seconds


def _cp_seconds(shape: ModelShape, cluster: Cluster, layout: Layout, blocks: tuple[int, ...]) -> float:
    model = shape.model
    size = 2 * layout.micro_batch * shape.seq_len * model.kv_heads * model.head_dim / layout.tp * value_bytes(shape)
    gather = collective_seconds(cluster, "all_gather", layout.cp, size, stride=layout.tp)
    scatter = collective_seconds(cluster, "reduce_scatter", layout.cp, size, stride=layout.tp)
    gathers = 2 if layout.checkpointing == "full" else 1
    return layout.microbatches * len(blocks) * (gathers * gather + scatter)


def _ep_seconds(shape: ModelShape, cluster: Cluster, layout: Layout, blocks: tuple[int, ...]) -> float:
    moe_blocks = sum(shape.blocks[index].moe for index in blocks)
    if not moe_blocks or layout.ep == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq_len / layout.cp
    size = tokens * shape.expert_share * shape.model.moe.num_experts * shape.model.d_model * value_bytes(shape)
    one = collective_seconds(cluster, "all_to_all", layout.ep, size, stride=layout.tp * layout.cp)
    passes = 2 + (1 if layout.checkpointing == "full" else 0)
    return layout.microbatches * moe_blocks * passes * 2 * one


def _pp_seconds(shape: ModelShape, cluster: Cluster, layout: Layout) -> float:
    if layout.pp == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq_len / layout.cp
    size = tokens * shape.model.d_model * value_bytes(shape) / (layout.tp if layout.sequence_parallel else 1)
    stride = layout.tp * layout.cp * layout.dp
    one = collective_seconds(cluster, "send_recv", 2, size, stride=stride)
    return 2 * layout.microbatches * layout.stages_per_rank * one


def overlaps_compute(cluster: Cluster, layout: Layout) -> bool:
    """Whether collectives can run beside compute: not on a CPU node whose cores the layout's processes already
    fill (gloo moves and adds the bytes on the CPU, so its threads take turns with the compute)."""
    concurrent = cluster.concurrent_devices or cluster.devices_per_node
    return not (cluster.device == "cpu" and min(layout.world_size, cluster.devices_per_node) >= concurrent)


def _dp_seconds(shape: ModelShape, cluster: Cluster, layout: Layout, where: Placement, rank: int,
                times: MicrobatchTimes) -> float:
    """Exposed data-parallel time of one pp rank (module docstring)."""
    counts = rank_parameters(shape, where, rank, layout.tp)
    expert = counts[1]
    bucket = shape.config.parallel.bucket_mb * 2**20
    overlap = 1.0 if overlaps_compute(cluster, layout) else 0.0
    backward = overlap * (2 * times.forward() + times.recompute(layout.checkpointing))
    forward = overlap * times.forward()
    # (parameters, group size, stride) per kind: dense over dp x cp, experts over dp / ep x cp
    groups = [(dense_parameters_per_tp_rank(counts, layout.tp), layout.dp * layout.cp, layout.tp),
              (expert / layout.ep, layout.dp // layout.ep * layout.cp, layout.tp * layout.cp * layout.ep)]
    exposed = 0.0
    for parameters, ranks, stride in groups:
        if ranks <= 1 or parameters == 0:
            continue
        size = GRADIENT_BYTES * parameters
        buckets = max(1, math.ceil(size / bucket))
        reduce = "all_reduce" if layout.zero_stage == 0 else "reduce_scatter"
        reduce_time = collective_seconds(cluster, reduce, ranks, size, stride, calls=buckets)
        exposed += max(reduce_time - backward, reduce_time / buckets)
        if layout.zero_stage in (1, 2):
            gather = collective_seconds(cluster, "all_gather", ranks, size, stride, calls=buckets)
            exposed += max(gather - forward, gather / buckets)
        elif layout.zero_stage == 3:
            units = max(1, len(where.rank_blocks[rank]))
            size = value_bytes(shape) * parameters
            gather = collective_seconds(cluster, "all_gather", ranks, size, stride, calls=units)
            passes = [(forward, gather)] if layout.pp > 1 else [(forward, gather), (backward, gather)] * layout.microbatches
            exposed += sum(max(moved - computed, moved / units) for computed, moved in passes)
    return exposed


def step_time(shape: ModelShape, cluster: Cluster, layout: Layout, where: Placement,
              per_rank: list[MicrobatchTimes] | None = None, ranks: Sequence[int] | None = None) -> StepTime:
    """The predicted :class:`StepTime` of ``layout`` (module docstring): every term taken on the pp rank whose
    microbatch is slowest; ``per_rank``: each pp rank's :func:`microbatch_times` when already known; ``ranks``: the
    pp ranks, in order, whose terms are compared (default all of them; :func:`~xscale.estimate.placement.rank_kinds`
    gives one of each kind, the same result)."""
    if per_rank is None:
        per_rank = [microbatch_times(shape, cluster, layout, blocks, rank == where.head_rank)
                    for rank, blocks in enumerate(where.rank_blocks)]
    ranks = range(layout.pp) if ranks is None else ranks
    slowest = max(ranks, key=lambda rank: 3 * per_rank[rank].forward() + per_rank[rank].recompute(layout.checkpointing))
    times, blocks = per_rank[slowest], where.rank_blocks[slowest]
    compute = layout.microbatches * (3 * times.forward() + times.recompute(layout.checkpointing))
    communication = {
        "tp": max(_tp_seconds(shape, cluster, layout, where.rank_blocks[rank], (rank == 0, rank == where.head_rank))
                  for rank in ranks),
        "cp": _cp_seconds(shape, cluster, layout, blocks),
        "ep": _ep_seconds(shape, cluster, layout, blocks),
        "pp": _pp_seconds(shape, cluster, layout),
        "dp": max(_dp_seconds(shape, cluster, layout, where, rank, per_rank[rank]) for rank in ranks),
    }
    optimizer = 0.0
    for rank in ranks:
        counts = rank_parameters(shape, where, rank, layout.tp)
        shards = layout.dp * layout.cp if layout.zero_stage >= 1 else 1
        expert_shards = max(1, layout.dp // layout.ep * layout.cp) if layout.zero_stage >= 1 else 1
        updated = dense_parameters_per_tp_rank(counts, layout.tp) / shards + counts[1] / layout.ep / expert_shards
        optimizer = max(optimizer, OPTIMIZER_BYTES_PER_PARAMETER * updated / (
            cluster.memory_bandwidth * cluster.compute_share(layout.world_size)))
    overhead = step_dispatch_seconds(cluster) / cluster.compute_share(layout.world_size)
    bubble = shared_bubble_seconds(compute, bubble_seconds(layout, times), cluster.compute_share(layout.world_size))
    return StepTime(compute, bubble, optimizer, communication, overhead)
