"""Helpers shared by the kernel modules: launch checks and interpreter quirks."""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True when the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be upcast to float32 first.

    Triton 3.9's interpreter stores bfloat16 as uint16 and its ``create_dot`` multiplies those raw bit
    patterns, so a bf16 ``tl.dot`` returns garbage on CPU. Upcasting is exact (bf16 -> fp32 is lossless),
    so the interpreted result equals what the GPU computes (bf16 inputs, fp32 accumulation).
    """
    return interpreting() and dtype in (torch.bfloat16, torch.float16)


def dot_precision() -> str:
    """``tl.dot``'s precision for fp32 operands, as torch's matmuls: full fp32 ("ieee") unless TF32 is allowed
    (``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision("high")``). Triton's
    default is TF32, whose 10-bit mantissa put the fp32 kernel 1e-3 away from the fp32 reference on an H200."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
