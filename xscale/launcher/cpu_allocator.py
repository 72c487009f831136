"""Keep freed memory in the process when training on CPU, so large tensors stop page-faulting every step.

glibc's malloc hands a freed block above its mmap threshold straight back to the kernel and trims the heap's top
above its trim threshold; a training step that frees and re-allocates tens of MiB of activations and gradients then
maps them again page by page, one fault per 4 KiB. Raising the mmap threshold to glibc's 64-bit maximum (32 MiB)
and never trimming keeps those pages mapped for the next step, which is what the allocators PyTorch's CPU launcher
recommends preloading (jemalloc, tcmalloc) do by design. Resident memory then stays at the step's peak.

Measured by ``xscale bench moe`` on 2 idle cores (fp32, 4096 tokens; README "Benchmarks / MoE"): the MoE layer's
step 138 -> 120 ms, DeepSpeed's MoE 159 -> 149 ms, the dense FFN 97 -> 94 ms.
Applied by the trainer on CPU and by ``xscale bench``; ``XSCALE_SYSTEM_MALLOC=1`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
NEVER_TRIM = (1 << 31) - 1

_applied = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to 32 MiB and turn heap trimming off (once per process).

    Returns whether the setting is in effect: False off glibc (macOS, musl) or with ``XSCALE_SYSTEM_MALLOC=1``.
    """
    global _applied
    if _applied:
        return True
    if os.environ.get("XSCALE_SYSTEM_MALLOC") == "1" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (and these mallopt parameters)
            return False
    except OSError:
        return False
    _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                               NEVER_TRIM))
    return _applied


FOLLOW_MMAP_THRESHOLD = 64 << 10
FOLLOW_TRIM_THRESHOLD = 128 << 10


def return_freed_memory() -> bool:
    """The opposite setting, for measuring: every block above 64 KiB is its own mapping, returned to the kernel when
    freed, and the heap is trimmed above 128 KiB, so the resident set follows the live tensors
    (``xscale bench memory``). Returns whether glibc took the setting; keep_freed_memory() is not applied after it
    in this process (``XSCALE_SYSTEM_MALLOC=1`` is set)."""
    os.environ["XSCALE_SYSTEM_MALLOC"] = "1"
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, FOLLOW_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, FOLLOW_TRIM_THRESHOLD))
