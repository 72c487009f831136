"""Whether this CPU computes bf16 natively: without AVX512_BF16 or AMX, bf16 matmuls are emulated (converted to
fp32 and back) and run slower than fp32, so a bf16 run's throughput and MFU say little about bf16 hardware. With
AVX512_BF16 but no AMX tiles they are native yet still slower than fp32: 151 against 306 GFLOP/s on a 2-core Intel
Xeon of this kind (best GEMM rates, docs/benchmarks.md, 2026-11-28); only AMX makes CPU bf16 the faster choice."""

from __future__ import annotations

import torch

from xscale.runtime.cpu_flags import cpu_flags

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX, from the CPU's flags or the kernels torch dispatched to."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS) or "BF16" in capability or "AMX" in capability


def cpu_has_amx() -> bool:
    """AMX tiles for bf16, from the CPU's flags or the kernels torch dispatched to."""
    return "amx_bf16" in cpu_flags() or "AMX" in torch.backends.cpu.get_cpu_capability().upper()


def bf16_warning(precision: str, device_type: str) -> str | None:
    """The one-line warning for bf16 on a CPU where it is slower than fp32 (no AMX), else None. Callers print it
    once, at start."""
    if precision != "bf16" or device_type != "cpu" or cpu_has_amx():
        return None
    if cpu_has_native_bf16():
        return ("xscale: warning: precision=bf16 on a CPU with AVX512_BF16 but no AMX: its bf16 matmuls run at about "
                "half the fp32 rate (151 vs 306 GFLOP/s on a 2-core Xeon of this kind); fp32 is likely faster here")
    return (f"xscale: warning: precision=bf16 on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}, "
            "no AVX512_BF16/AMX): bf16 is emulated and usually slower than fp32 here")
