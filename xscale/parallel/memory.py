"""Per-rank bytes of model state: predicted by the ZeRO paper's formulas, and measured on a live engine.

ZeRO (Rajbhandari et al. 2020, sec. 5) with Psi parameters over N data-parallel ranks, in fp32 with AdamW
(4 bytes per value, two moments: K = 8 bytes of optimizer state per parameter; fp32 weights are their own master):

    stage 0 (DDP):        params 4 Psi     grads 4 Psi     optimizer 8 Psi
    stage 1 (P_os):       params 4 Psi     grads 4 Psi     optimizer 8 Psi / N
    stage 2 (P_os+g):     params 4 Psi     grads 4 Psi / N optimizer 8 Psi / N
    stage 3 (P_os+g+p):   params 4 Psi / N grads 4 Psi / N optimizer 8 Psi / N

Tensor and pipeline parallelism divide Psi first (Psi / (tp x pp), exact for the sharded matrices; norms are
replicated over tp, so the prediction is slightly low under tp).
"""

from __future__ import annotations

import torch

from xscale.parallel.data import local_tensor
from xscale.parallel.dims import ParallelDims

BYTES_PER_VALUE = 4
OPTIMIZER_VALUES = 2  # AdamW: exp_avg, exp_avg_sq


def predicted_state_bytes(num_params: int, dims: ParallelDims) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one rank under ``dims`` (formulas above)."""
    per_model_parallel_rank = num_params / (dims.tp * dims.pp)
    n = dims.dp
    stage = dims.zero_stage if n > 1 else 0
    value = BYTES_PER_VALUE * per_model_parallel_rank
    return {
        "parameters": value / n if stage >= 3 else value,
        "gradients": value / n if stage >= 2 else value,
        "optimizer": OPTIMIZER_VALUES * value / n if stage >= 1 else OPTIMIZER_VALUES * value,
    }


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


def measured_state_bytes(engine, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds right after backward (before the optimizer step): parameters, gradients (whole,
    or ZeRO-2 chunks) and optimizer moments."""
    params = list(engine.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    grads += [shard.grad for group in optimizer.param_groups for shard in group["params"] if shard.grad is not None]
    moments = [value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor)]
    return {"parameters": _unique_bytes(params), "gradients": _unique_bytes(grads), "optimizer": _unique_bytes(moments)}
