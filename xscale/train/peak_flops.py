"""The denominator of MFU: the best FLOP/s this device reaches on large matrix products, measured once and cached.

One square product under-states a CPU or GPU whose kernels prefer another aspect ratio, so the peak is the best of
several large GEMM shapes (Chowdhery et al. 2022, appendix B divide by the hardware's peak; without a datasheet
figure, the best achieved GEMM rate is the honest stand-in). ``train.peak_flops`` pins it. The measurement
takes a few seconds, so it is kept in ``~/.cache/xscale/peak_flops.json`` (``$XSCALE_CACHE_DIR``, else
``$XDG_CACHE_HOME``, moves it), keyed by torch version, device (CPU model or GPU name), dtype, thread count and the
way it was measured: any of them changing measures again. A cached value also measures again when it is older than
``MAX_AGE_DAYS`` or, on a CPU, out of line with the same CPU's value at another thread count (a measurement taken
while the machine was busy), and :class:`MfuDenominator` measures again when a step beats the peak (MFU > 100%).
On a GPU, MFU is also reported against the datasheet's dense peak (:func:`datasheet_peak_flops`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

# (m, k, n) of A[m, k] @ B[k, n]: square, tall-skinny and wide products, the shapes of a Transformer's projections.
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 1024),
                                                 (1024, 4096, 1024), (2048, 1024, 4096))
# A CPU reaches its GEMM rate at smaller sizes, and emulated bf16 (no AVX512_BF16/AMX) runs ~15x slower than fp32:
# products of at most 2 GFLOP keep the one-time measurement to seconds there.
CPU_GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((512, 512, 512), (1024, 1024, 1024), (2048, 512, 512),
                                                     (512, 2048, 512), (1024, 512, 2048))
MIN_SECONDS = 0.2  # each shape runs at least this long (after a warm-up) so one slow call does not decide

GemmTimer = Callable[[tuple[int, int, int], torch.dtype, str], float]


def product_seconds(a: torch.Tensor, b: torch.Tensor, device: str) -> float:
    """Seconds of one ``a @ b``: the mean over repeats lasting ``MIN_SECONDS``, after a warm-up."""
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b  # warm-up: kernel selection, page faults
    synchronize()
    repeats, start = 0, time.perf_counter()
    while repeats < 1 or time.perf_counter() - start < MIN_SECONDS:
        a @ b
        repeats += 1
    synchronize()
    return (time.perf_counter() - start) / repeats


def gemm_seconds(shape: tuple[int, int, int], dtype: torch.dtype, device: str,
                 timer: Callable[[torch.Tensor, torch.Tensor, str], float] = product_seconds) -> float:
    """Seconds of one ``[m, k] @ [k, n]`` product on ``device``, the faster of the two layouts of the right operand:
    ``[k, n]`` row-major, and ``[n, k]`` read transposed (``nn.Linear``'s ``x @ W^T``). Kernels differ by layout: on a
    CPU without native bf16 the transposed layout ran 4-5x faster in bf16, so one layout alone understated the peak
    that a model's projections reach."""
    m, k, n = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    row_major = torch.randn(k, n, dtype=dtype, device=device)
    transposed = torch.randn(n, k, dtype=dtype, device=device).t()
    return min(timer(a, b, device) for b in (row_major, transposed))


def best_gemm_flops(dtype: torch.dtype, device: str = "cpu", shapes: tuple[tuple[int, int, int], ...] | None = None,
                    seconds: GemmTimer = gemm_seconds) -> float:
    """The highest FLOP/s (2mkn per product) over ``shapes`` (default: the device's: GEMM_SHAPES, CPU_GEMM_SHAPES)."""
    if shapes is None:
        shapes = CPU_GEMM_SHAPES if device == "cpu" else GEMM_SHAPES
    return max(2.0 * m * k * n / seconds((m, k, n), dtype, device) for m, k, n in shapes)


def device_name(device: str) -> str:
    """What the peak depends on besides dtype: the GPU's name, or the CPU model and the threads torch uses."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_model()} x{torch.get_num_threads()} threads"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_file() -> Path:
    if directory := os.environ.get("XSCALE_CACHE_DIR"):
        return Path(directory) / "peak_flops.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xscale" / "peak_flops.json"


MEASUREMENT = "both layouts"  # in the key: a value cached by the one-layout measurement is measured again
MAX_AGE_DAYS = 30  # a driver, BIOS or microcode update changes the peak without changing any part of the key
# Threads of one CPU: n threads reach at most n/m times m threads' rate, and at least about m threads' rate. Beyond
# these margins one of the two values was measured while other work held the cores.
SCALING_SLACK = 1.5


def _threads_apart(device: str) -> str:
    """The key of this device's entries at every thread count: the CPU model without the thread count."""
    return f"torch {torch.__version__} | {cpu_model() if device == 'cpu' else device_name(device)} | {MEASUREMENT}"


def cache_key(dtype: torch.dtype, device: str) -> str:
    return (f"torch {torch.__version__} | {device_name(device)} | {str(dtype).removeprefix('torch.')} | "
            f"{MEASUREMENT}")


def _entry(value: object) -> dict | None:
    """A usable cache entry: ``{"flops", "measured_at", ...}`` with a positive rate (a bare number, the format of
    earlier releases, has no date and is measured again)."""
    if (isinstance(value, dict) and isinstance(value.get("flops"), (int, float)) and value["flops"] > 0
            and isinstance(value.get("measured_at"), (int, float))):
        return value
    return None


def scaling_conflict(flops: float, threads: int, other_flops: float, other_threads: int) -> bool:
    """Whether ``flops`` at ``threads`` cannot sit beside ``other_flops`` at ``other_threads`` on the same CPU:
    more threads slower than fewer (beyond ``SCALING_SLACK``), or faster than linear scaling allows."""
    if threads == other_threads:
        return False
    (few_flops, few), (many_flops, many) = sorted(((flops, threads), (other_flops, other_threads)),
                                                  key=lambda pair: pair[1])
    return many_flops * SCALING_SLACK < few_flops or many_flops > few_flops * (many / few) * SCALING_SLACK


def implausible(entry: dict, cached: dict, now: float) -> str | None:
    """Why a cached entry must be measured again (too old, out of line with another thread count), or None."""
    age_days = (now - entry["measured_at"]) / 86400
    if age_days > MAX_AGE_DAYS or age_days < 0:
        return f"measured {age_days:.0f} days ago (kept at most {MAX_AGE_DAYS})"
    for other in filter(None, map(_entry, cached.values())):
        if (other.get("apart") == entry.get("apart") and other.get("dtype") == entry.get("dtype")
                and isinstance(other.get("threads"), int) and isinstance(entry.get("threads"), int)
                and scaling_conflict(entry["flops"], entry["threads"], other["flops"], other["threads"])):
            return (f"{entry['flops'] / 1e9:.1f} GFLOP/s at {entry['threads']} threads is out of line with "
                    f"{other['flops'] / 1e9:.1f} GFLOP/s at {other['threads']}")
    return None


def peak_flops(dtype: torch.dtype, device: str = "cpu", path: Path | None = None,
               measure: Callable[[torch.dtype, str], float] | None = None, fresh: bool = False,
               now: Callable[[], float] = time.time) -> float:
    """This device's peak FLOP/s for ``dtype``: from the cache, or measured (:func:`best_gemm_flops`) and cached.
    ``fresh`` (or a cached value :func:`implausible` finds too old or out of line) measures again and replaces it.
    An unreadable cache is measured over; an unwritable one only costs the next run the measurement."""
    path = path or cache_file()
    key = cache_key(dtype, device)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    entry = _entry(cached.get(key))
    if entry is not None and not fresh:
        if (reason := implausible(entry, cached, now())) is None:
            return float(entry["flops"])
        print(f"xscale: the cached matmul peak is measured again: {reason} ({path})", flush=True)
    value = (measure or best_gemm_flops)(dtype, device)
    cached[key] = {"flops": value, "measured_at": now(), "apart": _threads_apart(device),
                   "dtype": str(dtype).removeprefix("torch."),
                   "threads": torch.get_num_threads() if device == "cpu" else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(cached, indent=1, sort_keys=True))
        temporary.replace(path)  # concurrent runs each write a whole file
    except OSError:
        pass
    return value


class MfuDenominator:
    """The peak FLOP/s behind ``perf/mfu``, which a step can never beat: a step faster than the peak (MFU > 100%)
    shows the peak was measured low (a busy machine, a stale cache), so it is measured again, once per run; if the
    step still beats it, the step's own rate is the peak (a lower bound on the truth, so MFU reads 100% at most).
    A pinned peak (``train.peak_flops``) is kept and a step beating it is said once."""

    def __init__(self, dtype: torch.dtype, device: str, pinned: float | None = None,
                 measure: Callable[..., float] = peak_flops,
                 announce: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.dtype, self.device, self.pinned, self.measure, self.announce = dtype, device, pinned, measure, announce
        self.peak = pinned or measure(dtype, device)
        self.remeasured = self.warned = False

    def mfu(self, achieved_flops: float) -> float:
        """Model FLOP utilisation of ``achieved_flops`` (FLOP/s of one device)."""
        if achieved_flops > self.peak and self.pinned:
            if not self.warned:
                self.announce(f"xscale: a step reached {achieved_flops / 1e9:.1f} GFLOP/s per device, above "
                              f"train.peak_flops={self.pinned:g}: MFU reads above 100%; raise train.peak_flops")
                self.warned = True
        elif achieved_flops > self.peak:
            low = self.peak
            if not self.remeasured:
                self.remeasured = True
                self.peak = self.measure(self.dtype, self.device, fresh=True)
            if achieved_flops > self.peak:
                self.peak = achieved_flops
            self.announce(f"xscale: a step reached {achieved_flops / 1e9:.1f} GFLOP/s per device, above the matmul "
                          f"peak of {low / 1e9:.1f} GFLOP/s; the peak is now {self.peak / 1e9:.1f} GFLOP/s "
                          "(pin it with train.peak_flops)")
        return achieved_flops / self.peak


# Dense (no 2:4 sparsity) tensor-core bf16 and plain fp32 (TF32 off, torch's default for matmuls) FLOP/s from NVIDIA's
# datasheets, keyed by a substring of torch.cuda.get_device_name: the first key found in the name wins, so a variant
# (PCIe, NVL) comes before its family's SXM entry.
DATASHEET_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float32: 51.2e12},
    "H100 NVL": {torch.bfloat16: 835.5e12, torch.float32: 60e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12},  # SXM: "NVIDIA H100 80GB HBM3"
    "H200 NVL": {torch.bfloat16: 835.5e12, torch.float32: 60e12},
    "H200": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float32: 19.5e12},
}


def datasheet_flops_for(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet dense peak of the GPU called ``name`` in ``dtype``, or None for a GPU or dtype not listed."""
    for key, peaks in DATASHEET_PEAK_FLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def datasheet_peak_flops(dtype: torch.dtype, device: torch.device | str) -> float | None:
    """``device``'s datasheet dense peak in ``dtype`` (:data:`DATASHEET_PEAK_FLOPS`); None on a CPU or an unlisted
    GPU, where the measured GEMM peak (:func:`peak_flops`) is the only denominator."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return datasheet_flops_for(torch.cuda.get_device_name(device), dtype)
