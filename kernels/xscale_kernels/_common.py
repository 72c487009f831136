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


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
