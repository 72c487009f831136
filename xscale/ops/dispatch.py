"""Choice of kernel backend for the fused ops: auto | triton | apex | torch."""

from __future__ import annotations

_BACKENDS = ("auto", "triton", "apex", "torch")
_backend = "auto"


def set_kernel_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend '{name}' is not one of {', '.join(_BACKENDS)}")
    _backend = name


def get_kernel_backend() -> str:
    return _backend
