"""AdamW with decoupled weight decay on matrices only (Loshchilov & Hutter 2019).

Norm gains, biases and other 1-D parameters are not decayed, as in GPT-2/3 and Megatron.

How the update runs (``train.optimizer_foreach``): torch's ``foreach`` AdamW applies each step of the update to
all parameters at once, so each of its intermediate results (``exp_avg_sq.sqrt()``, the bias-corrected step) is a
list of temporaries as large as all of this rank's parameters together; on a machine where the model states
nearly fill memory that is the difference between fitting and not. ``false`` updates one parameter at a time
(temporaries bounded by the largest parameter); ``auto`` uses torch's ``fused`` kernel wherever torch has one (CUDA and
CPU among them): one pass over each parameter's four tensors, no temporaries. On CPU it took 7 ms where the
per-parameter update took 25 and ``foreach`` 32 (a 5M-parameter decoder, 2 threads, ``docs/benchmarks.md``).
``true`` forces ``foreach``, ``false`` the per-parameter update. All compute the same update (fused to the last bit of
float32 rounding).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from xscale.config.schema import TrainConfig


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


def fused_devices() -> tuple[str, ...]:
    """Device types with a fused AdamW kernel in this torch (CUDA only where torch does not say)."""
    return tuple(getattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"])())


def update_mode(setting: bool | str, device_type: str) -> str:
    """``fused``, ``foreach`` or ``per_parameter`` for ``train.optimizer_foreach`` (auto, true or false) on
    ``device_type`` (module docstring)."""
    if setting is True:
        return "foreach"
    if setting is False:
        return "per_parameter"
    return "fused" if device_type in fused_devices() else "per_parameter"


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig,
                    source_ndim: dict[int, int] | None = None) -> torch.optim.Optimizer:
    """AdamW, its update run as ``train.optimizer_foreach`` says (module docstring)."""
    groups = parameter_groups(params, train.weight_decay, source_ndim)
    first = next((p for group in groups for p in group["params"]), None)
    mode = update_mode(train.optimizer_foreach, first.device.type if first is not None else "cpu")
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             foreach=mode == "foreach", fused=True if mode == "fused" else None)
