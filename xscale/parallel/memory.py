"""Per-rank bytes of model state: predicted by the ZeRO paper's formulas, and measured on a live model.

ZeRO (Rajbhandari et al. 2020, sec. 5) with Psi parameters over N data-parallel ranks, in fp32 with AdamW
(4 bytes per value, two moments: K = 8 bytes of optimizer state per parameter; fp32 weights are their own master):

    stage 0 (DDP):        params 4 Psi     grads 4 Psi     optimizer 8 Psi
    stage 1 (P_os):       params 4 Psi     grads 4 Psi     optimizer 8 Psi / N
    stage 2 (P_os+g):     params 4 Psi     grads 4 Psi / N optimizer 8 Psi / N
    stage 3 (P_os+g+p):   params 4 Psi / N grads 4 Psi / N optimizer 8 Psi / N

Tensor and pipeline parallelism divide Psi first (Psi / (tp x pp), exact for the sharded matrices; norms are
replicated over tp, so the prediction is slightly low under tp). Per pipeline rank,
:func:`predicted_pipeline_state_bytes` applies the formulas to what that rank's stages hold: the first stage the
embedding, the last the head, and with tied embeddings the last its own copy, as an encoder-decoder's first decoder stage holds
one of the embedding (so the stages hold more than Psi). Under expert parallelism the Psi_E expert
parameters are divided by ep x pp instead (experts are replicated over tp) and ZeRO shards them over the edp
ranks that hold the same experts, N_E = dp / ep, instead of N. Context parallelism (cp) does not divide Psi: its
ranks hold the same parameters, and ZeRO shards over them too, N = dp x cp.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from xscale.config import Config
from xscale.models import build_model
from xscale.parallel.data import is_expert_parameter, local_tensor
from xscale.parallel.dims import ParallelDims
from xscale.parallel.pipeline import SCHEDULES
from xscale.parallel.pipeline.cost import stage_layers
from xscale.parallel.pipeline.stages import stage_to_rank

BYTES_PER_VALUE = 4
OPTIMIZER_VALUES = 2  # AdamW: exp_avg, exp_avg_sq


def predicted_state_bytes(num_params: int, dims: ParallelDims, expert_params: int = 0) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one rank under ``dims`` (formulas above);
    ``expert_params`` of the ``num_params`` are MoE expert weights (they matter only when ep > 1)."""
    stage = dims.zero_stage if dims.dp_cp > 1 else 0
    if dims.ep > 1:
        kinds = [(num_params - expert_params, dims.tp * dims.pp, dims.dp), (expert_params, dims.ep * dims.pp, dims.edp)]
    else:  # context-parallel ranks hold the same parameters: ZeRO shards over dp x cp
        kinds = [(num_params, dims.tp * dims.pp, dims.dp_cp)]
    state = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    for count, model_parallel, n in kinds:
        value = BYTES_PER_VALUE * count / model_parallel
        state["parameters"] += value / n if stage >= 3 else value
        state["gradients"] += value / n if stage >= 2 else value
        state["optimizer"] += OPTIMIZER_VALUES * value / n if stage >= 1 else OPTIMIZER_VALUES * value
    return state


def pipeline_rank_parameters(config: Config, dims: ParallelDims) -> list[tuple[int, int]]:
    """(parameters, expert parameters) of each pp rank's stages, counted on meta-device stage modules."""
    parallel = config.parallel
    num_stages = dims.pp * parallel.pp_stages_per_rank
    ranks = stage_to_rank(num_stages, dims.pp, SCHEDULES[parallel.pp_schedule].placement)
    meta = build_model(config.model, materialize=False)
    counts = [[0, 0] for _ in range(dims.pp)]
    for index, layers in enumerate(stage_layers(config, num_stages)):
        stage = copy.deepcopy(meta)
        stage.keep_layers(layers)
        for name, param in stage.named_parameters():  # a last stage's output.weight is the tied copy
            counts[ranks[index]][0] += param.numel()
            counts[ranks[index]][1] += param.numel() if is_expert_parameter(name) else 0
    return [(total, expert) for total, expert in counts]


def predicted_pipeline_state_bytes(config: Config, dims: ParallelDims) -> list[dict[str, float]]:
    """:func:`predicted_state_bytes` of each pp rank over the parameters its stages hold."""
    within_stage = dataclasses.replace(dims, pp=1)
    return [predicted_state_bytes(total, within_stage, expert)
            for total, expert in pipeline_rank_parameters(config, dims)]


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by ``tensors``: the union of their memory ranges, so views and slices of one buffer count once
    (0-dim counters skipped)."""
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                    for t in map(local_tensor, tensors) if t.ndim > 0 and t.numel() > 0)
    total, end = 0, -1
    for start, stop in ranges:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def measured_state_bytes(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds right after backward (before the optimizer step): parameters, gradients (whole,
    or ZeRO-2 chunks) and optimizer moments."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    grads += [shard.grad for group in optimizer.param_groups for shard in group["params"] if shard.grad is not None]
    moments = [value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor)]
    return {"parameters": _unique_bytes(params), "gradients": _unique_bytes(grads), "optimizer": _unique_bytes(moments)}
