"""The Python face of every fused op.

Each op here dispatches to a Triton kernel (``kernels/xscale_kernels``), to apex when importable,
or to the PyTorch reference, according to its ``backend`` argument (``train.kernels``); see
``xscale/ops/dispatch.py`` for the rules and ``kernels/README.md`` for where each op lives.
"""

from xscale.ops.block_sparse_attention import BlockLayout, build_layout
from xscale.ops.dispatch import BACKENDS, check_backend
from xscale.ops.functional import (
    apply_rope,
    block_sparse_attention,
    cross_entropy_sum,
    gated_activation,
    layer_norm,
    layer_norm_residual,
    linear_cross_entropy_sum,
    moe_permute,
    moe_unpermute,
    rms_norm,
    rms_norm_residual,
)
from xscale.ops.moe_permute import Permutation

__all__ = [
    "BACKENDS",
    "BlockLayout",
    "Permutation",
    "apply_rope",
    "block_sparse_attention",
    "build_layout",
    "check_backend",
    "cross_entropy_sum",
    "gated_activation",
    "layer_norm",
    "layer_norm_residual",
    "linear_cross_entropy_sum",
    "moe_permute",
    "moe_unpermute",
    "rms_norm",
    "rms_norm_residual",
]
