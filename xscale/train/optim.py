"""AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter 2019).

Norm gains, biases and other 1-D parameters are not decayed, as in GPT-2/3 and Megatron.

How the update runs (``train.optimizer_foreach``): :mod:`xscale.ops.optimizer_update`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from xscale.config.schema import TrainConfig
from xscale.ops.optimizer_update import update_mode


def parameter_groups(params: Iterable[nn.Parameter], weight_decay: float,
                     source_ndim: dict[int, int] | None = None) -> list[dict]:
    """Split into decayed (matrices) and not decayed; ``source_ndim`` maps id(param) to the rank of the model
    parameter it stands for (a flat ZeRO shard decays like the matrix it is cut from)."""
    decay, no_decay = [], []
    for param in params:
        if not param.requires_grad:
            continue
        ndim = source_ndim.get(id(param), param.ndim) if source_ndim else param.ndim
        (decay if ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig,
                    source_ndim: dict[int, int] | None = None) -> torch.optim.Optimizer:
    """AdamW, its update run as ``train.optimizer_foreach`` says (module docstring)."""
    groups = parameter_groups(params, train.weight_decay, source_ndim)
    first = next((p for group in groups for p in group["params"]), None)
    mode = update_mode(train.optimizer_foreach, first.device.type if first is not None else "cpu")
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             foreach=mode == "foreach", fused=True if mode == "fused" else None)
