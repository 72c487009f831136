"""Which AdamW update kernel runs: fused, foreach or one parameter at a time.

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

from torch.optim import optimizer as torch_optimizer


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
