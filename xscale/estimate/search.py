"""The planner's search: every layout of N devices worth predicting, ranked by predicted tokens/s.

Enumerated (then pruned): tp dividing a node's devices, the heads and the kv heads; cp in 1, 2, 4 within a node
with tp; pp dividing what tp x cp leave, at most one block per stage; dp the rest, dividing the global batch; ep
dividing the experts and dp; ZeRO 0-3; the micro-batch size (powers of two) or the pipeline's microbatch count (each
count the schedule runs); schedules 1f1b, gpipe, interleaved 1F1B (2 or 4 stages per rank) and ZB-V; recomputation
none, selective (cores that store their scores) or full, the first that fits (recomputation only adds time).
A layout is kept when its predicted peak fits ``MEMORY_USABLE`` of the device (a layout whose model state alone,
:meth:`Planner.state_floor`, is above that is skipped unpredicted: activations and buffers only add to it); the best
ones are then checked by the validator (:func:`xscale.parallel.checks.resolve_layout` and the config's own checks) until ``top`` pass.
Ties (equal tokens/s to 3 digits, :func:`rank_key`) go to the simpler layout (:meth:`~xscale.estimate.layout.Layout.complexity`),
then to the smaller peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xscale.config.check import validate
from xscale.config.schema import Config, ConfigError
from xscale.estimate.activations import FUSED_ATTENTION_KINDS
from xscale.estimate.cluster import Cluster
from xscale.estimate.collective_memory import collective_buffer_bytes
from xscale.estimate.in_flight import blocks_in_flight
from xscale.estimate.layout import Layout
from xscale.estimate.layout_memory import peak_bytes
from xscale.estimate.memory import predicted_state_bytes
from xscale.estimate.model_shape import ModelShape
from xscale.estimate.placement import Placement, placement, rank_kinds, rank_parameters
from xscale.estimate.step_time import MicrobatchTimes, StepTime, microbatch_times, step_time
from xscale.parallel.checks import resolve_layout
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank
from xscale.parallel.pipeline.cost import balanced_split, pipeline_costs
from xscale.parallel.pipeline.schedules import microbatch_problem
from xscale.parallel.pipeline.stages import split_layers

MEMORY_USABLE = 0.9  # of each device's memory: the rest for the CUDA context, NCCL buffers and fragmentation
CONTEXT_PARALLEL = (1, 2, 4)
MAX_MICRO_BATCH = 32
PIPELINE_SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
                      ("zero_bubble", 2))


class PlanError(ConfigError):
    """No layout can run: the message says why (one line)."""


@dataclass
class Plan:
    """A ranked layout: its predicted step, peak bytes per rank, tokens/s, MFU; ``overrides`` run it."""

    layout: Layout
    step: StepTime
    peak_bytes: float
    tokens_per_s: float
    mfu: float

    @property
    def overrides(self) -> dict[str, object]:
        return self.layout.overrides()


def divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def _checkpointing_options(shape: ModelShape) -> tuple[str, ...]:
    """Recomputation in order of cost; selective only where it saves memory (cores that store their scores)."""
    fused = shape.model.attention.kind in FUSED_ATTENTION_KINDS
    return ("none", "full") if fused else ("none", "selective", "full")


def _degrees(shape: ModelShape, cluster: Cluster, devices: int) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) of ``devices`` the enumeration considers (module docstring)."""
    model, batch = shape.model, shape.global_batch
    found = []
    for tp in divisors(cluster.devices_per_node):
        if model.n_heads % tp or (model.kv_heads != 1 and model.kv_heads % tp) or devices % tp:
            continue
        for cp in CONTEXT_PARALLEL:
            if tp * cp > cluster.devices_per_node or (devices // tp) % cp or shape.seq_len % (2 * cp):
                continue
            if cp > 1 and model.family != "decoder":
                continue
            for pp in divisors(devices // (tp * cp)):
                dp = devices // (tp * cp * pp)
                if pp <= model.total_layers and batch % dp == 0:
                    found.append((tp, cp, pp, dp))
    return found


def _batch_splits(local: int, pp: int, schedule: str, stages_per_rank: int) -> list[tuple[int, int]]:
    """(micro-batch size, microbatches) of a dp rank's ``local`` sequences."""
    if pp == 1:
        return [(size, local // size) for size in divisors(local)
                if size <= MAX_MICRO_BATCH and (size & (size - 1) == 0 or size == local)]
    return [(local // count, count) for count in divisors(local)
            if microbatch_problem(schedule, pp, stages_per_rank, count) is None]


def candidate_layouts(shape: ModelShape, cluster: Cluster, devices: int) -> list[Layout]:
    """Every layout the search predicts, recomputation none (module docstring)."""
    experts = shape.model.moe.num_experts
    layouts = []
    for tp, cp, pp, dp in _degrees(shape, cluster, devices):
        local = shape.global_batch // dp
        schedules = [("1f1b", 1)] if pp == 1 else [
            (name, v) for name, v in PIPELINE_SCHEDULES if shape.model.total_layers >= pp * v]
        for ep in [e for e in divisors(dp) if experts and experts % e == 0] or [1]:
            for zero in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):
                for schedule, v in schedules:
                    for micro, count in _batch_splits(local, pp, schedule, v):
                        layouts.append(Layout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero_stage=zero, micro_batch=micro,
                                              microbatches=count, schedule=schedule, stages_per_rank=v,
                                              sequence_parallel=tp > 1))
    return layouts


class Planner:
    """Predicts layouts of one model on one cluster, caching what layouts share (placements, in-flight counts, each
    rank's microbatch times and model state)."""

    def __init__(self, shape: ModelShape, cluster: Cluster, devices: int) -> None:
        self.shape, self.cluster, self.devices = shape, cluster, devices
        self._placements: dict[tuple, tuple[Placement, tuple[int, ...]]] = {}
        self._in_flight: dict[tuple, list[float]] = {}
        self._stage_layers: dict[int, list[list[int]]] = {}
        self._microbatch_times: dict[tuple, list[MicrobatchTimes]] = {}
        self._state_floors: dict[tuple, float] = {}
        self._costs = pipeline_costs(shape.config)  # the pipeline's own balance, computed once

    def stage_layers(self, num_stages: int) -> list[list[int]]:
        """:func:`xscale.parallel.pipeline.cost.stage_layers` of an unset ``pp_split``, the costs computed once."""
        if num_stages not in self._stage_layers:
            count = len(self._costs.blocks)
            self._stage_layers[num_stages] = split_layers(count, num_stages, balanced_split(self._costs, num_stages))
        return self._stage_layers[num_stages]

    def _pipeline_key(self, layout: Layout) -> tuple:
        return (layout.pp, layout.stages_per_rank, layout.schedule if layout.pp > 1 else "")

    def placement(self, layout: Layout) -> Placement:
        return self._placement_and_kinds(layout)[0]

    def _placement_and_kinds(self, layout: Layout) -> tuple[Placement, tuple[int, ...]]:
        """The layout's :class:`Placement` and its :func:`~xscale.estimate.placement.rank_kinds`."""
        key = self._pipeline_key(layout)
        if key not in self._placements:
            where = placement(layout.apply(self.shape.config), self.stage_layers(layout.pp * layout.stages_per_rank))
            self._placements[key] = where, rank_kinds(self.shape, where)
        return self._placements[key]

    def in_flight(self, config: Config, layout: Layout, where: Placement) -> list[float]:
        """(block, microbatch) activations each pp rank holds at once."""
        if layout.pp == 1:
            return [float(len(where.rank_blocks[0]))]
        key = (*self._pipeline_key(layout), layout.microbatches)
        if key not in self._in_flight:
            num_stages = layout.pp * layout.stages_per_rank
            ranks = stage_to_rank(num_stages, layout.pp, SCHEDULES[layout.schedule].placement)
            self._in_flight[key] = blocks_in_flight(config, layout.pp, ranks, self.stage_layers(num_stages))
        return self._in_flight[key]

    def microbatch_times(self, layout: Layout, where: Placement) -> list[MicrobatchTimes]:
        """Each pp rank's :func:`~xscale.estimate.step_time.microbatch_times`: the same for every ZeRO stage,
        microbatch count and recomputation, so computed once for them all."""
        key = (*self._pipeline_key(layout), layout.world_size, layout.micro_batch, layout.tp, layout.cp, layout.ep,
               layout.sequence_parallel)
        if key not in self._microbatch_times:
            self._microbatch_times[key] = [
                microbatch_times(self.shape, self.cluster, layout, blocks, rank == where.head_rank)
                for rank, blocks in enumerate(where.rank_blocks)]
        return self._microbatch_times[key]

    def state_floor(self, layout: Layout) -> float:
        """A lower bound on :meth:`predict`'s peak whatever the recomputation and batch split: the largest pp rank's
        model state (parameters, gradients and optimizer state: :attr:`PeakTerms.peak
        <xscale.estimate.memory.PeakTerms.peak>` adds the rest to them) with the runtime's memory."""
        key = (*self._pipeline_key(layout), layout.tp, layout.dp, layout.ep, layout.cp, layout.zero_stage)
        if key not in self._state_floors:
            where, dims = self.placement(layout), dataclasses.replace(layout.dims(), pp=1)
            states = [predicted_state_bytes(total, dims, expert, replicated)
                      for total, expert, replicated in (rank_parameters(self.shape, where, rank, layout.tp)
                                                        for rank in range(layout.pp))]
            self._state_floors[key] = (max(state["parameters"] + state["optimizer"] + state["gradients"]
                                           for state in states) + self.cluster.runtime_memory_bytes)
        return self._state_floors[key]

    def peak_bytes(self, layout: Layout) -> float:
        """The predicted peak per rank: the memory model's, the collectives' buffers and the runtime's."""
        config = layout.apply(self.shape.config)
        where = self.placement(layout)
        return (peak_bytes(self.shape, config, layout, where, self.in_flight(config, layout, where))
                + collective_buffer_bytes(self.shape, self.cluster, layout, where) + self.cluster.runtime_memory_bytes)

    def predict(self, layout: Layout, peak: float | None = None) -> Plan:
        """``layout``'s plan; ``peak``: its :meth:`peak_bytes` when already known."""
        peak = self.peak_bytes(layout) if peak is None else peak
        where, kinds = self._placement_and_kinds(layout)
        step = step_time(self.shape, self.cluster, layout, where, self.microbatch_times(layout, where), kinds)
        tokens_per_s = self.shape.global_batch * self.shape.seq_len / step.total
        mfu = self.shape.model_flops_per_token * tokens_per_s / (
            self.devices * self.cluster.peak_flops[_dtype(self.shape.config)])
        return Plan(layout, step, peak, tokens_per_s, mfu)

    def fits(self, plan: Plan) -> bool:
        return plan.peak_bytes <= MEMORY_USABLE * self.cluster.memory_bytes

    def first_fitting(self, layout: Layout) -> Plan | None:
        """``layout`` with the first recomputation that fits (recomputation only adds time), None if none does."""
        for checkpointing in _checkpointing_options(self.shape):
            chosen = dataclasses.replace(layout, checkpointing=checkpointing)
            peak = self.peak_bytes(chosen)  # the step is predicted only for the recomputation that fits
            if peak <= MEMORY_USABLE * self.cluster.memory_bytes:
                return self.predict(chosen, peak)
        return None

    def smallest(self, layouts: list[Layout]) -> Plan:
        """The plan of least peak over ``layouts`` and every recomputation (the first in enumeration order among
        equals), predicting in the order of :meth:`state_floor` until the floor passes the least peak found."""
        floors = [self.state_floor(layout) for layout in layouts]
        best: tuple[float, int, int, Layout] | None = None
        for index in sorted(range(len(layouts)), key=floors.__getitem__):
            if best is not None and floors[index] > best[0]:
                break
            for order, checkpointing in enumerate(_checkpointing_options(self.shape)):
                chosen = dataclasses.replace(layouts[index], checkpointing=checkpointing)
                peak = self.peak_bytes(chosen)
                if best is None or (peak, index, order) < best[:3]:
                    best = (peak, index, order, chosen)
        return self.predict(best[3], best[0])


def _dtype(config: Config) -> str:
    return "bf16" if config.train.low_precision else "fp32"


def accepted(config: Config, devices: int) -> bool:
    """Whether the validator takes ``config`` at ``devices`` processes (config checks, then the layout's)."""
    try:
        validate(config)
        resolve_layout(config, devices)
    except ConfigError:
        return False
    return True


def rank_key(plan: Plan) -> tuple:
    """The search's order: predicted tokens/s to 3 digits, descending; ties to the simpler layout
    (:meth:`~xscale.estimate.layout.Layout.complexity`), then the smaller peak."""
    return (-float(f"{plan.tokens_per_s:.3g}"), plan.layout.complexity(), plan.peak_bytes)


def search(shape: ModelShape, cluster: Cluster, devices: int, top: int = 5) -> list[Plan]:
    """The ``top`` fastest layouts that fit and pass the validator, best first; :class:`PlanError` when none."""
    if devices < 1:
        raise PlanError(f"--devices must be at least 1, got {devices}")
    planner = Planner(shape, cluster, devices)
    candidates = candidate_layouts(shape, cluster, devices)
    if not candidates:
        raise PlanError(f"no layout uses {devices} devices: the global batch of {shape.global_batch} sequences "
                        f"does not split over the data-parallel degrees left after tp x cp x pp "
                        f"(<= {cluster.devices_per_node * max(CONTEXT_PARALLEL)} x {shape.model.total_layers}); "
                        f"use fewer devices or a larger train.global_batch_size")
    usable = MEMORY_USABLE * cluster.memory_bytes
    fitting = [plan for plan in (planner.first_fitting(layout) for layout in candidates
                                 if planner.state_floor(layout) <= usable) if plan is not None]
    if not fitting:
        smallest = planner.smallest(candidates)
        raise PlanError(f"nothing fits on {devices} devices of {cluster.memory_bytes / 2**30:.0f} GiB: the smallest "
                        f"predicted peak is {smallest.peak_bytes / 2**30:.1f} GiB per rank ({smallest.layout.describe()}), "
                        f"above the {MEMORY_USABLE:.0%} usable; use more devices")
    fitting.sort(key=rank_key)
    chosen = []
    for plan in fitting:
        if accepted(plan.layout.apply(shape.config), devices):
            chosen.append(plan)
            if len(chosen) == top:
                break
    if not chosen:
        raise PlanError(f"none of the {len(fitting)} layouts that fit {devices} devices passes the validator")
    return chosen
