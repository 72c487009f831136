"""The Python face of every fused op.

Each op here dispatches to a Triton kernel (``kernels/xscale_kernels``), to apex when importable,
or to the PyTorch reference, according to :func:`set_kernel_backend` (``train.kernels``).
"""

from xscale.ops.dispatch import get_kernel_backend, set_kernel_backend
from xscale.ops.reference import (
    apply_rope,
    cross_entropy_sum,
    gated_activation,
    linear_cross_entropy_sum,
    rms_norm,
)

__all__ = [
    "apply_rope",
    "cross_entropy_sum",
    "gated_activation",
    "get_kernel_backend",
    "linear_cross_entropy_sum",
    "rms_norm",
    "set_kernel_backend",
]
