"""``train.sdpa_backend``: which kernel ``F.scaled_dot_product_attention`` may use in the step's forward.

``auto`` leaves the choice to PyTorch (flash, then memory-efficient, then cuDNN, then math, by what the inputs
allow); ``flash``, ``efficient``, ``cudnn`` or ``math`` pins one through ``torch.nn.attention.sdpa_kernel``, so a
run that could not use it fails at its first step with PyTorch's reason instead of silently falling back. Backward
runs the kernel its forward chose.
"""

from __future__ import annotations

import contextlib

from xscale.config.schema import ConfigError

SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
CUDA_ONLY = ("efficient", "cudnn")


def check_sdpa_backend(name: str, device_type: str) -> None:
    """A ConfigError saying what to change when ``name`` is unknown or has no kernel on this device."""
    if name not in SDPA_BACKENDS:
        raise ConfigError(f"train.sdpa_backend={name!r} is not one of {', '.join(SDPA_BACKENDS)}")
    if name in CUDA_ONLY and device_type != "cuda":
        raise ConfigError(f"train.sdpa_backend={name} runs on CUDA only and this run is on {device_type}: "
                         "use auto, flash or math")


def sdpa_backend_context(name: str) -> contextlib.AbstractContextManager:
    """The context that pins SDPA to ``name`` (nothing for ``auto``)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel([backend])
