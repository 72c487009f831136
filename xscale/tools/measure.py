"""``xscale inspect --measure``: does a layout fit, measured before it is launched.

One training step (forward, backward, AdamW step) of one micro-batch of the single-device model runs under
``FakeTensorMode`` (shapes and dtypes only: nothing is allocated, no GPU, no cluster) while torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``) follows every tensor it creates; the peak of what is
neither a parameter, a gradient nor an optimizer state is the step's activations and temporaries. Each distinct
rank's share of that (Korthikanti et al. 2022, sec. 4) is added to its model state from the ZeRO formulas
(:mod:`xscale.parallel.memory`):

- tensor parallelism divides every activation by tp under sequence parallelism (eq. 5), and without it all but
  the replicated ``10 s b h`` of the ``s b h (34 + 5 a s / h)`` bytes per layer (eq. 2);
- context parallelism divides them by cp (each rank's T/cp queries; the gathered K/V it keeps are not counted);
- a pipeline rank holds its share of the layers for the micro-batches in flight: min(pp - rank, m) under the
  1F1B schedules, all m under GPipe;
- activation checkpointing and bf16 autocast run as configured.

Not counted: ZeRO-3's all-gathered layer weights, the K/V a context-parallel rank gathers, the communication
buffers, and the runtime's own memory (CUDA context, allocator slack). Models whose step has data-dependent shapes
(MoE dispatch) cannot run on fake tensors and are refused. On CPU the prediction is within 2% of the peak resident
set of two real steps of ``configs/tiny-gpt.yaml`` (tests/tools/test_inspect.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from xscale.config import Config
from xscale.models import build_model
from xscale.models.parameters import count_parameters
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.parallel.checks import resolve_layout
from xscale.parallel.dims import ParallelDims
from xscale.parallel.memory import OPTIMIZER_VALUES, predicted_pipeline_state_bytes, predicted_state_bytes
from xscale.parallel.model import ParallelModel
from xscale.parallel.parallelize import micro_batch_size
from xscale.train.step import forward_backward_step, model_optimizer, optimizer_step

GIB = 1024**3


class MeasureError(ValueError):
    """The step cannot run on fake tensors (an op whose output shape depends on the data, as MoE dispatch)."""


@dataclass
class RankMemory:
    """One distinct rank's predicted peak: model state (formulas) plus activations and temporaries (measured)."""

    label: str
    state: dict[str, float]
    activations: float

    @property
    def peak(self) -> float:
        return sum(self.state.values()) + self.activations


def _fake_model(config: Config) -> nn.Module:
    """The single-device model with fake parameters and buffers (built on meta, then given fake storage)."""
    model = build_model(config.model, materialize=False).use_kernels(config.train.kernels)
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


class ActivationPeakTracker(MemTracker):
    """A ``MemTracker`` that also keeps the highest sum, after any op, of what is not model state (activations,
    temporaries, other): the total peak may fall in the optimizer step, when activations are gone."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_peak = 0

    def _update_peak_stats(self, peak_state) -> None:  # called by MemTracker after every op it tracks
        super()._update_peak_stats(peak_state)
        for snapshot in self._curr_mem_snap.values():
            by_kind = {getattr(kind, "value", kind): value for kind, value in snapshot.items()}
            # the optimizer step's temporaries are tracked as optimizer state: beyond AdamW's two moments
            moments = min(by_kind.get("Optstate", 0), OPTIMIZER_VALUES * by_kind.get("Parameter", 0))
            current = by_kind["Total"] - moments - sum(by_kind.get(kind, 0) for kind in ("Parameter", "Buffer", "Gradient"))
            self.activation_peak = max(self.activation_peak, current)


def measured_activation_bytes(config: Config, micro_batch: int) -> float:
    """Peak bytes of activations and temporaries of one training step of ``micro_batch`` sequences of
    ``train.seq_len`` tokens on the single-device model, measured on fake tensors (module docstring)."""
    autocast = torch.bfloat16 if config.train.precision == "bf16" else None
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        model = _fake_model(config)
        parallel = ParallelModel([model], micro_batch_size=micro_batch, autocast_dtype=autocast)
        optimizer = model_optimizer(parallel, config.train)
        tracker = ActivationPeakTracker()
        tracker.track_external(model, optimizer)
        try:
            with tracker:
                forward_backward_step(parallel, _batch(config, micro_batch))
                optimizer_step(parallel, optimizer)
        except (DynamicOutputShapeException, GuardOnDataDependentSymNode) as error:
            raise MeasureError("--measure cannot run this model on fake tensors: an op's output shape depends on "
                               f"the data ({type(error).__name__}; MoE token dispatch is one); "
                               "plan it without --measure") from None
    return float(tracker.activation_peak)


def _replicated_fraction(config: Config) -> float:
    """Share of a layer's activations that tensor parallelism without sequence parallelism leaves whole on every
    rank: 10 of s b h (34 + 5 a s / h) (Korthikanti et al. 2022, eq. 2)."""
    model = config.model
    return 10 / (34 + 5 * model.n_heads * config.train.seq_len / model.d_model)


def _tensor_parallel_share(config: Config, dims: ParallelDims) -> float:
    if dims.tp == 1 or config.parallel.sequence_parallel:
        return 1 / dims.tp
    replicated = _replicated_fraction(config)
    return replicated + (1 - replicated) / dims.tp


def _in_flight(config: Config, pp: int, pp_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once (GPipe: all; 1F1B: pp - rank)."""
    microbatches = config.parallel.microbatches or pp
    return microbatches if config.parallel.pp_schedule == "gpipe" else min(pp - pp_rank, microbatches)


def rank_memory(config: Config, world_size: int) -> list[RankMemory]:
    """Each distinct rank's predicted peak at ``world_size``: one per pipeline rank (the others are alike)."""
    dims, config = resolve_layout(config, world_size)
    if dims.pp > 1:  # a pipeline micro-batch: the local batch over the microbatches
        micro = max(1, config.train.global_batch_size // dims.dp // dims.microbatches)
    else:
        micro = micro_batch_size(config, dims)
    share = _tensor_parallel_share(config, dims) / dims.cp
    activations = measured_activation_bytes(config, micro) * share
    if dims.pp == 1:
        count = count_parameters(config)
        return [RankMemory("every rank", predicted_state_bytes(count.total, dims, count.expert), activations)]
    return [RankMemory(f"pp rank {rank}", state, activations / dims.pp * _in_flight(config, dims.pp, rank))
            for rank, state in enumerate(predicted_pipeline_state_bytes(config, dims))]


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


def measure_report(config: Config, world_size: int, device_memory_gib: float | None = None) -> list[str]:
    """Lines of ``xscale inspect --measure``: each distinct rank's predicted peak and whether it fits."""
    available, source = device_memory_bytes(world_size, device_memory_gib)
    lines = [f"measured step (fake tensors, MemTracker; device memory {_gib(available)} from {source}):"]
    for rank in rank_memory(config, world_size):
        state = sum(rank.state.values())
        lines.append(f"  {rank.label}: model state {_gib(state)} + activations {_gib(rank.activations)} "
                     f"= peak {_gib(rank.peak)}: {verdict(rank.peak, available)}")
    return lines
