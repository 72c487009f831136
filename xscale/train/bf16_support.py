"""Whether this CPU computes bf16 natively: without AVX512_BF16 or AMX, bf16 matmuls are emulated (converted to
fp32 and back) and run slower than fp32, so a bf16 run's throughput and MFU say little about bf16 hardware."""

from __future__ import annotations

from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX, from the CPU's flags or the kernels torch dispatched to."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS) or "BF16" in capability or "AMX" in capability


def bf16_warning(precision: str, device_type: str) -> str | None:
    """The one-line warning for bf16 on a CPU without native bf16, else None. Callers print it once, at start."""
    if precision != "bf16" or device_type != "cpu" or cpu_has_native_bf16():
        return None
    return (f"xscale: warning: precision=bf16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}, "
            "no AVX512_BF16/AMX): bf16 is emulated and usually slower than fp32 here")
