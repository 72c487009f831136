"""``xscale inspect --measure``: does a layout fit, measured before it is launched.

The forward and backward of one micro-batch of the single-device model run under ``FakeTensorMode`` (shapes and
dtypes only: nothing is allocated, no GPU, no cluster) while torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``) follows every tensor it creates; at the peak of activations plus
gradients it reads the activations and temporaries (what is neither a parameter, a gradient nor an optimizer state)
and the share of the gradients that exist. Each distinct rank's share of the activations (Korthikanti et al. 2022,
sec. 4) goes into its :class:`~xscale.estimate.memory.PeakTerms` with the ZeRO model state, ZeRO-3's gathered
weights, the live gradients and the optimizer step's temporaries (formulas in :mod:`xscale.estimate.memory`):

- tensor parallelism divides every activation by tp under sequence parallelism (eq. 5), and without it all but
  the replicated ``10 s b h`` of the ``s b h (34 + 5 a s / h)`` bytes per layer (eq. 2);
- context parallelism divides them by cp (each rank's T/cp queries; the gathered K/V it keeps are not counted);
- a pipeline rank holds its layers' activations (the last stage also the head's, once: fake steps at depth L and 1
  split them) for the micro-batches in flight: min(pp - rank, m) under the 1F1B schedules, all m under GPipe;
- what the layout allocates itself (:class:`LayoutTerms`): tensor parallelism's vocabulary-parallel loss in place
  of the fused loss's logits chunk, the pipeline's receive buffers (one per microbatch) and what it has sent
  (the outputs kept for their backward, the gradients until their send is waited for), and with gradients
  accumulated over m > 1 microbatches a backward after the first (every gradient, min(in flight, m - 1)
  microbatches at their activation peak);
- activation checkpointing and bf16 autocast run as configured.

Not counted: the K/V a context-parallel rank gathers, the row-parallel all-reduce outputs beyond the replicated
activations of eq. 2, and the runtime's own memory (CUDA context, allocator slack, gloo's and the pipeline's
non-tensor memory: 13-20 MiB of resident set on each pipeline rank of ``xscale bench memory``'s model, no tensor);
``xscale bench memory`` measures how far off that leaves each layout. Models whose step has data-dependent shapes
(MoE dispatch) cannot run on fake tensors and are refused. On CPU the prediction is within 2% of the peak resident
set of two real steps of ``configs/tiny-gpt.yaml`` (tests/commands/test_inspect.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from xscale.config.schema import Config
from xscale.estimate.in_flight import blocks_in_flight
from xscale.estimate.memory import (
    OPTIMIZER_VALUES,
    PeakTerms,
    UnitSizes,
    accumulated_backward_bytes,
    activation_share,
    all_gather_bytes,
    head_activation_share,
    largest_gradient_bytes,
    live_gradient_bytes,
    microbatches_in_flight,
    parameter_gather_bytes,
    pipeline_buffer_bytes,
    pipeline_send_bytes,
    predicted_model_state_bytes,
    predicted_pipeline_state_bytes,
    step_temporary_bytes,
    unit_sizes,
    vocab_parallel_loss_bytes,
)
from xscale.estimate.step_runner import StepRunner
from xscale.models import build_model
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.parallel.checks import resolve_layout
from xscale.parallel.dims import ParallelDims
from xscale.parallel.model import ParallelModel
from xscale.parallel.parallelize import micro_batch_size
from xscale.parallel.pipeline import SCHEDULES
from xscale.parallel.pipeline.cost import stage_layers
from xscale.parallel.pipeline.stages import stage_to_rank
from xscale.parallel.pipeline.vocabulary import vocabulary_stage_count

GIB = 1024**3


class MeasureError(ValueError):
    """The step cannot run on fake tensors (an op whose output shape depends on the data, as MoE dispatch)."""


@dataclass
class RankMemory:
    """One distinct rank's predicted peak: :class:`PeakTerms` (formulas, activations measured on fake tensors)."""

    label: str
    terms: PeakTerms

    @property
    def state(self) -> dict[str, float]:
        return {"parameters": self.terms.parameters, "gradients": self.terms.gradients,
                "optimizer": self.terms.optimizer}

    @property
    def activations(self) -> float:
        return self.terms.activations

    @property
    def peak(self) -> float:
        return self.terms.peak


def _fake_model(config: Config) -> nn.Module:
    """The single-device model with fake parameters and buffers (built on meta, then given fake storage)."""
    model = build_model(config.model, materialize=False).use_kernels(
        config.train.kernels, config.train.sparse_attention)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                        requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    model.tie_weights()
    stacks = [stack for stack in (getattr(model, "stack", None), getattr(model, "decoder", None)) if stack is not None]
    apply_activation_checkpointing(stacks, config.parallel.activation_checkpointing)
    return model


def _batch(config: Config, rows: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, config.model.vocab_size, (rows, config.train.seq_len))
    batch = {"input_ids": ids, "labels": ids}
    if config.model.family == "encoder_decoder":
        batch["decoder_input_ids"] = ids
    return batch


class ActivationPeaks:
    """Put on torch's ``MemTracker`` (:func:`activation_peak_tracker_class`): a tracker that also keeps the highest
    sum, after any op, of what is not model state (activations, temporaries, other), and the highest sum of that and
    the gradients alive at the time (``joint_peak``), with its two parts: backward frees activations as it makes
    gradients, so the peak of both is not the sum of their peaks."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_peak = 0
        self.joint_peak = self.activations_at_joint_peak = self.gradient_fraction_at_joint_peak = 0.0

    def _update_peak_stats(self, peak_state) -> None:  # called by MemTracker after every op it tracks
        # In place of MemTracker's own: it walks every module's statistics after every op (three quarters of the
        # time of a 1.1B model's measure), for per-module peaks nothing here reads.
        for snapshot in self._curr_mem_snap.values():
            by_kind = {getattr(kind, "value", kind): value for kind, value in snapshot.items()}
            # the optimizer step's temporaries are tracked as optimizer state: beyond AdamW's two moments
            moments = min(by_kind.get("Optstate", 0), OPTIMIZER_VALUES * by_kind.get("Parameter", 0))
            current = by_kind["Total"] - moments - sum(by_kind.get(kind, 0) for kind in ("Parameter", "Buffer", "Gradient"))
            self.activation_peak = max(self.activation_peak, current)
            gradients = by_kind.get("Gradient", 0)
            if current + gradients > self.joint_peak:
                self.joint_peak, self.activations_at_joint_peak = current + gradients, current
                self.gradient_fraction_at_joint_peak = gradients / max(by_kind.get("Parameter", 0), 1)


@functools.cache
def activation_peak_tracker_class() -> type:
    """:class:`ActivationPeaks` on torch's ``MemTracker``, whose module loads ``torch._dynamo`` (seconds of every
    start-up): imported when a step is first measured, not by the commands that import this module."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return type("ActivationPeakTracker", (ActivationPeaks, MemTracker), {})


def measured_activation_bytes(config: Config, micro_batch: int, step: StepRunner) -> float:
    """Peak bytes of activations and temporaries of one training step of ``micro_batch`` sequences of
    ``train.seq_len`` tokens on the single-device model, measured on fake tensors (module docstring)."""
    return measured_step(config, micro_batch, step)[0]


def _activation_peak(config: Config, micro_batch: int, step: StepRunner) -> float:
    return measured_step(config, micro_batch, step)[2]


# The fake steps measured so far, by what they depend on (the single-device model, the training settings, the
# recomputation, the micro-batch): layouts that differ in ZeRO stage or degrees share one (xscale inspect's search
# for a layout that fits).
_MEASURED: dict[tuple[str, int, int], tuple[float, float, float]] = {}


def measured_step(config: Config, micro_batch: int, step: StepRunner) -> tuple[float, float, float]:
    """At the peak of activations plus gradients of one forward and backward (:class:`ActivationPeaks`):
    the bytes of activations and temporaries, and the share of the parameters that have a gradient by then; third,
    the peak of the activations and temporaries alone."""
    key = (repr((config.model, config.train, config.parallel.activation_checkpointing)), micro_batch, id(step))
    if key not in _MEASURED:
        _MEASURED[key] = _measure_step(config, micro_batch, step)
    return _MEASURED[key]


def _measure_step(config: Config, micro_batch: int, step: StepRunner) -> tuple[float, float, float]:
    autocast = torch.bfloat16 if config.train.low_precision else None
    tracker_class = activation_peak_tracker_class()  # imported before fake tensors are on
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        model = _fake_model(config)
        parallel = ParallelModel([model], micro_batch_size=micro_batch, autocast_dtype=autocast)
        optimizer = step.optimizer(parallel, config.train)
        tracker = tracker_class()
        tracker.track_external(model, optimizer)
        try:
            with tracker:  # the optimizer step's temporaries are a formula of their own (step_temporary_bytes)
                step.forward_backward(parallel, _batch(config, micro_batch))
        except (DynamicOutputShapeException, GuardOnDataDependentSymNode) as error:
            raise MeasureError("--measure cannot run this model on fake tensors: an op's output shape depends on "
                               f"the data ({type(error).__name__}; MoE token dispatch is one); "
                               "plan it without --measure") from None
    return (float(tracker.activations_at_joint_peak), float(tracker.gradient_fraction_at_joint_peak),
            float(tracker.activation_peak))


def rank_memory(config: Config, world_size: int, step: StepRunner) -> list[RankMemory]:
    """Each distinct rank's predicted peak at ``world_size``: one per pipeline rank (the others are alike); the
    terms are :mod:`xscale.estimate.memory`'s, the activations measured here on fake tensors."""
    dims, config = resolve_layout(config, world_size)
    if dims.pp > 1:  # a pipeline micro-batch: the local batch over the microbatches
        micro = max(1, config.train.global_batch_size // dims.dp // dims.microbatches)
        microbatches = dims.microbatches
    else:
        micro = micro_batch_size(config, dims)
        microbatches = max(1, config.train.global_batch_size // dims.dp // micro)
    tokens = micro * config.train.seq_len
    full, gradient_fraction, deep = measured_step(config, micro, step)
    share = activation_share(config, dims)
    if dims.pp == 1:
        state = predicted_model_state_bytes(config, dims)
        activations = full * share
        if dims.tp > 1:  # the layers by their share, the head without the fused loss's logits (tp's loss replaces it)
            per_layer, head = per_layer_and_head(config, micro, step, full, deep)
            activations = config.model.n_layers * per_layer * share + head_activation_share(config, dims, head, tokens)
        layout = LayoutTerms(microbatches, 1, activations * deep / max(full, 1.0), 0.0,
                             vocab_parallel_loss_bytes(config, dims, tokens // dims.cp))
        return [_rank("every rank", config, dims, state, activations, unit_sizes(config, tp=dims.tp), gradient_fraction, layout)]
    num_stages = dims.pp * config.parallel.pp_stages_per_rank
    ranks = stage_to_rank(num_stages, dims.pp, SCHEDULES[config.parallel.pp_schedule].placement)
    layers = stage_layers(config, num_stages)
    per_layer, head = per_layer_and_head(config, micro, step, full, deep)  # at the joint peak of activations and gradients
    peak_layer, peak_head = per_layer_and_head(config, micro, step, deep, deep)  # at the activation peak
    rows = []
    vocabulary = vocabulary_stage_count(config.parallel)
    resolved = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, microbatches=microbatches))
    blocks_alive = blocks_in_flight(resolved, dims.pp, ranks, layers)  # (block, microbatch) activations at once
    for rank, state in enumerate(predicted_pipeline_state_bytes(config, dims)):
        mine = [stage for stage in range(num_stages) if ranks[stage] == rank]
        held = [index for stage in mine for index in layers[stage]]
        # the share of the head (output projection and loss) this rank computes: all of it on the last stage's rank,
        # or 1/pp on every rank under vocabulary parallelism
        head_share = 1.0 / vocabulary if vocabulary else float(num_stages - 1 in mine)
        in_flight = microbatches_in_flight(config, dims.pp, rank)
        # the blocks' activations stay for each microbatch in flight (as the schedule's actions keep them); the
        # head's (mostly the loss's) come and go
        activations = (blocks_alive[rank] * per_layer * share
                       + head_share * head_activation_share(config, dims, head, tokens))
        transient = head_share * head_activation_share(config, dims, peak_head, tokens)
        loss = head_share * vocab_parallel_loss_bytes(config, dims, tokens // dims.cp, in_flight)
        layout = LayoutTerms(microbatches, blocks_alive[rank] / max(len(held), 1), len(held) * peak_layer * share,
                             transient, loss, pipeline_buffer_bytes(config, dims, tokens // dims.cp, mine)
                             + pipeline_send_bytes(config, dims, tokens // dims.cp, mine))
        rows.append(_rank(f"pp rank {rank}", config, dims, state, activations, unit_sizes(config, held, dims.tp),
                          gradient_fraction, layout))
    return rows


def per_layer_and_head(config: Config, micro_batch: int, step: StepRunner, full: float | None = None,
                       deep: float | None = None) -> tuple[float, float]:
    """One block's share of ``full`` activations (default: the measured ones) and the rest's (embedding, final
    norm, head and loss: the last pipeline stage's), split as the activation peaks of fake steps at the model's
    depth L (``deep`` if already measured) and at depth 1 are: A(L) = L a + h. An encoder-decoder is split
    evenly."""
    depth = config.model.n_layers
    full = measured_activation_bytes(config, micro_batch, step) if full is None else full
    if depth == 1 or config.model.family == "encoder_decoder":
        return full / max(depth, 1), 0.0
    deep = _activation_peak(config, micro_batch, step) if deep is None else deep
    one = _activation_peak(dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=1)),
                           micro_batch, step)
    per_layer = min(max(deep - one, 0.0) / (depth - 1) / deep, 1 / depth)  # never a negative head
    return full * per_layer, full * (1 - depth * per_layer)


@dataclass
class LayoutTerms:
    """What a rank's layout allocates besides the model's activations (:mod:`xscale.estimate.memory`): the
    microbatches gradients accumulate over, those in flight, one microbatch's activations at their peak (``held``)
    and the head's that come and go (``transient``); tp's vocabulary-parallel loss; the pipeline's receive buffers."""

    microbatches: int
    in_flight: float  # microbatches whose activations each held block keeps at once (on average over them)
    held: float
    transient: float
    vocab_parallel_loss: float = 0.0
    pipeline_buffers: float = 0.0


def _rank(label: str, config: Config, dims: ParallelDims, state: dict[str, float], activations: float,
          sizes: UnitSizes, gradient_fraction: float, layout: LayoutTerms) -> RankMemory:
    local = state["optimizer"] / OPTIMIZER_VALUES  # the parameters (pieces) this rank updates
    temporaries = step_temporary_bytes(config, dims, sizes, local)
    live = live_gradient_bytes(dims, state["gradients"], gradient_fraction, sizes)
    accumulated = accumulated_backward_bytes(layout.microbatches, layout.in_flight, layout.held, layout.transient,
                                             state["gradients"], largest_gradient_bytes(dims, sizes))
    forward_start, gather_in_forward = parameter_gather_bytes(config, dims, sizes, state["gradients"])
    return RankMemory(label, PeakTerms(**state, activations=activations, all_gather=all_gather_bytes(config, dims, sizes),
                                       live_gradients=live, step_temporaries=temporaries,
                                       vocab_parallel_loss=layout.vocab_parallel_loss,
                                       pipeline_buffers=layout.pipeline_buffers, accumulated_backward=accumulated,
                                       gather_in_forward=gather_in_forward, forward_start=forward_start))


def device_memory_bytes(processes_per_node: int, device_memory_gib: float | None = None) -> tuple[float, str]:
    """Memory one rank has: ``device_memory_gib`` if given, else the CUDA device's, else the host RAM
    (/proc/meminfo MemTotal) over the processes of one node."""
    if device_memory_gib is not None:
        return device_memory_gib * GIB, "--device-memory"
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                total = float(line.split()[1]) * 1024
    return total / processes_per_node, f"host RAM / {processes_per_node} process{'es' * (processes_per_node > 1)}"


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 100 else f"{value / 1024**2:.1f} MiB"


def verdict(peak: float, available: float) -> str:
    return "fits" if peak <= available else f"does not fit (needs {_gib(peak)}, has {_gib(available)})"


def measure_report(config: Config, world_size: int, step: StepRunner,
                   device_memory_gib: float | None = None) -> list[str]:
    """Lines of ``xscale inspect --measure``: each distinct rank's predicted peak and whether it fits."""
    available, source = device_memory_bytes(world_size, device_memory_gib)
    lines = [f"measured step (fake tensors, MemTracker; device memory {_gib(available)} from {source}):"]
    for rank in rank_memory(config, world_size, step):
        terms = rank.terms
        live = terms.gradients if terms.live_gradients is None else terms.live_gradients
        lines.append(f"  {rank.label}: model state {_gib(terms.model_state)} (parameters {_gib(terms.parameters)}, "
                     f"gradients {_gib(terms.gradients)}, optimizer {_gib(terms.optimizer)}); peak "
                     f"{_gib(rank.peak)}: {verdict(rank.peak, available)}")
        lines.append(f"    peak = parameters + optimizer + the largest of forward/backward (max(activations "
                     f"{_gib(terms.activations)} + live gradients {_gib(live)}, last microbatch's backward with "
                     f"accumulated gradients {_gib(terms.accumulated_backward)}) + all-gather {_gib(terms.all_gather)} "
                     f"+ vocab-parallel loss {_gib(terms.vocab_parallel_loss)} + pipeline buffers "
                     f"{_gib(terms.pipeline_buffers)} + ZeRO-1/2 gather in flight {_gib(terms.gather_in_forward)}), "
                     f"the optimizer step (gradients + temporaries {_gib(terms.step_temporaries)}) and the next "
                     f"forward's start (ZeRO-1/2's kept gradients + gathered parameters {_gib(terms.forward_start)})")
    return lines
