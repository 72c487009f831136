"""``xscale plan --calibrate OUT.yaml --device DEVICE --base CLUSTER.yaml``: measure one device (a GPU, or the CPU
for tests) and write the base cluster file with the measured figures replaced.

Measured on the device, in one process (:func:`measure_device`):

* GEMM rates: ``torch.matmul`` of (2048 x s) by (s x s) over :mod:`xscale.bench.calibrate`'s grid of s (on a
  device other than the CPU also s = 2048 and 4096, where a GPU's curve still rises), fp32 and bf16 (fp32 as torch
  runs it by default: no TF32 unless the process enabled it). Per shape: warm-up calls, then several timings of a
  batch of calls sized to take about :data:`TIMING_SECONDS`, each timed with CUDA events on a CUDA device, else
  between the device's synchronizations (on the CPU, on dedicated cores: :mod:`xscale.bench.contention`). The best
  timing gives the peak and the curve, as the CPU path does; the median is written in the file's header;
* the attention core: causal ``scaled_dot_product_attention`` forward + backward in the curve's dtype (bf16 off the
  CPU: torch's flash kernels), timed the same way over a grid of head dimensions and sequence lengths
  (:data:`DEVICE_ATTENTION`; the CPU path's grid on the CPU), each point's best rate at the FLOPs the cost model
  counts over that dtype's peak: ``attention_efficiency``;
* memory bandwidth: ``Tensor.copy_`` of 64 MiB on the CPU, 1 GiB elsewhere (bytes read + written), the best timing;
* the device's memory: ``get_device_properties(...).total_memory`` of the device's torch module (CUDA and the like),
  the host RAM over the base's devices per node on the CPU.

Everything else (devices per node, links, the framework's costs, runtime memory, ...) cannot be measured on one
device and is copied from the base (:func:`device_cluster`); the header says which figures are which.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from xscale.bench.calibrate import (
    ATTENTION_HEAD_DIMS,
    ATTENTION_HEADS,
    ATTENTION_LENGTHS,
    ATTENTION_TOKENS,
    GEMM_ROWS,
    GEMM_SIZES,
    QUICK_ATTENTION_HEAD_DIMS,
    QUICK_ATTENTION_LENGTHS,
    QUICK_GEMM_SIZES,
    attention_step,
    cpu_name,
)
from xscale.bench.contention import dedicated_seconds
from xscale.estimate.calibration import attention_grid, gemm_curve
from xscale.estimate.cluster import DTYPES, load_cluster
from xscale.estimate.measure import device_memory_bytes

DEVICE_GEMM_SIZES = (*GEMM_SIZES, 2048, 4096)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMING_SECONDS = 0.02  # one timing's batch of calls: long enough for the clock and the launch queue
MAX_CALLS = 1000
COPY_BYTES = {"cpu": 64 * 2**20}  # every other device: DEVICE_COPY_BYTES
DEVICE_COPY_BYTES = 2**30
MEASURED_KEYS = ("peak_tflops", "gemm_efficiency", "attention_efficiency", "memory_bandwidth_gbs", "memory_gib",
                 "device")
# off the CPU: (head dims, sequence lengths, tokens per call, heads) of the attention grid
DEVICE_ATTENTION = ((64, 128), (1024, 4096, 16384), 65536, 16)


class DeviceUnavailable(ValueError):
    """The requested device is not one torch can use here."""


@dataclass(frozen=True)
class GemmTimings:
    """Seconds per call of (GEMM_ROWS x size) @ (size x size), one entry per timing."""

    size: int
    seconds: tuple[float, ...]

    @property
    def flops(self) -> float:
        return 2.0 * GEMM_ROWS * self.size * self.size

    @property
    def best_rate(self) -> float:
        return self.flops / min(self.seconds)

    @property
    def median_rate(self) -> float:
        return self.flops / statistics.median(self.seconds)


@dataclass(frozen=True)
class DeviceMeasurement:
    """What :func:`measure_device` measured: GEMM timings per dtype, copy bandwidth (bytes/s) and the size it
    copied, the device's memory (bytes) and a description of the device."""

    gemms: dict[str, tuple[GemmTimings, ...]]
    memory_bandwidth: float
    copy_bytes: int
    memory_bytes: float
    description: str
    attention: tuple[tuple[float, float, float], ...] = ()  # (head dim, keys, best FLOP/s) in the curve's dtype


def resolve_device(name: str) -> torch.device:
    """``--device``'s device, checked: a :class:`DeviceUnavailable` saying why when torch cannot use it here."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise DeviceUnavailable(f"--device {name!r} is not a torch device ({str(error).splitlines()[0]})") from None
    if device.type == "cpu":
        return device
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        raise DeviceUnavailable(f"--device {name}: torch sees no {device.type} device here "
                                f"(torch.{device.type}.is_available() is not true); measure on a machine that has one")
    if device.index is not None and device.index >= module.device_count():
        raise DeviceUnavailable(f"--device {name}: only {module.device_count()} {device.type} device(s) here")
    return device


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds of one call of an action on ``device``: CUDA events on CUDA, else wall time between
    synchronizations (on the CPU: on dedicated cores)."""
    if device.type == "cuda":
        def cuda_seconds(action: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            action()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_seconds
    if device.type == "cpu":
        return lambda action: dedicated_seconds(action)[1]

    def synchronized_seconds(action: Callable[[], object]) -> float:
        _synchronize(device)
        start = time.perf_counter()
        action()
        _synchronize(device)
        return time.perf_counter() - start
    return synchronized_seconds


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work when it is this machine's accelerator (xpu, mps, ...); else nothing to
    wait for (the meta device)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == device.type:
        torch.accelerator.synchronize(device)


def time_calls(call: Callable[[], object], device: torch.device, timings: int) -> tuple[float, ...]:
    """Seconds per call of ``call`` in each of ``timings`` timings of a batch of calls (after a warm-up batch
    that also sizes the batch to about TIMING_SECONDS)."""
    timer = _timer(device)
    call()
    once = max(timer(call), 1e-9)
    calls = max(1, min(MAX_CALLS, int(TIMING_SECONDS / once)))

    def batch() -> None:
        for _ in range(calls):
            call()

    timer(batch)
    return tuple(timer(batch) / calls for _ in range(timings))


def gemm_timings(size: int, dtype: torch.dtype, device: torch.device, timings: int) -> GemmTimings:
    left = torch.randn(GEMM_ROWS, size, device=device).to(dtype)
    right = torch.randn(size, size, device=device).to(dtype)
    return GemmTimings(size, time_calls(lambda: torch.matmul(left, right), device, timings))


def copy_bandwidth(device: torch.device, timings: int) -> tuple[float, int]:
    """(best bytes/s read + written, bytes copied) of ``Tensor.copy_`` on ``device``."""
    size = COPY_BYTES.get(device.type, DEVICE_COPY_BYTES)
    source = torch.randn(size // 4, device=device)
    target = torch.empty_like(source)
    best = min(time_calls(lambda: target.copy_(source), device, timings))
    return 2 * size / best, size


def device_memory(device: torch.device, devices_per_node: int) -> tuple[float, str]:
    """(bytes, description) of ``device``: its torch module's total_memory, or the host RAM over a node's
    devices on the CPU."""
    if device.type == "cpu":
        memory, _ = device_memory_bytes(devices_per_node)
        return memory, f"{cpu_name()}, one thread, torch {torch.__version__}"
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else module.current_device()
    properties = module.get_device_properties(index)
    return float(properties.total_memory), f"{properties.name}, torch {torch.__version__}"


def measure_device(device: torch.device, devices_per_node: int, quick: bool) -> DeviceMeasurement:
    """GEMM timings, copy bandwidth and memory of ``device`` (module docstring); one thread on the CPU."""
    sizes = QUICK_GEMM_SIZES if quick else (GEMM_SIZES if device.type == "cpu" else DEVICE_GEMM_SIZES)
    timings = 3 if quick else 7
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the events record on the current device's stream
    try:
        gemms = {name: tuple(gemm_timings(size, dtype, device, timings) for size in sizes)
                 for name, dtype in TORCH_DTYPES.items()}
        attention = attention_rates(device, quick, timings)
        bandwidth, copied = copy_bandwidth(device, timings)
    finally:
        torch.set_num_threads(threads)
    memory, description = device_memory(device, devices_per_node)
    return DeviceMeasurement(gemms, bandwidth, copied, memory, description, attention)


def attention_rates(device: torch.device, quick: bool, timings: int) -> tuple[tuple[float, float, float], ...]:
    """(head dim, keys, best FLOP/s) of causal SDPA forward + backward over the grid, in the curve's dtype."""
    if device.type == "cpu":
        head_dims, lengths = ((QUICK_ATTENTION_HEAD_DIMS, QUICK_ATTENTION_LENGTHS) if quick
                              else (ATTENTION_HEAD_DIMS, ATTENTION_LENGTHS))
        tokens, heads = ATTENTION_TOKENS, ATTENTION_HEADS
    else:
        head_dims, lengths, tokens, heads = DEVICE_ATTENTION
        head_dims, lengths = (head_dims[:1], lengths[:2]) if quick else (head_dims, lengths)
    dtype = TORCH_DTYPES[curve_dtype(device.type)]
    rates = []
    for head_dim in head_dims:
        for length in lengths:
            step, flops = attention_step(head_dim, length, tokens, heads, device, dtype)
            rates.append((float(head_dim), (length + 1) / 2, flops / min(time_calls(step, device, timings))))
    return tuple(rates)


def curve_dtype(device_type: str) -> str:
    """The dtype whose curve the file keeps: fp32 on the CPU (xscale's CPU default), bf16 elsewhere."""
    return "fp32" if device_type == "cpu" else "bf16"


def device_cluster(base: dict, measurement: DeviceMeasurement, device_type: str) -> dict:
    """The base cluster mapping with :data:`MEASURED_KEYS` replaced by ``measurement``'s figures."""
    data = dict(base)
    data["name"] = f"{base.get('name', 'cluster')}-calibrated"
    data["device"] = "cpu" if device_type == "cpu" else "gpu"
    data["memory_gib"] = round(measurement.memory_bytes / 2**30, 3)
    data["memory_bandwidth_gbs"] = round(measurement.memory_bandwidth / 1e9, 3)
    peaks = {}
    for dtype in DTYPES:
        peak, curve = gemm_curve({timing.size: timing.best_rate for timing in measurement.gemms[dtype]})
        peaks[dtype] = round(peak / 1e12, 6)
        if dtype == curve_dtype(device_type):
            data["gemm_efficiency"] = curve
            if measurement.attention:
                data["attention_efficiency"] = attention_grid(list(measurement.attention), peak)
    data["peak_tflops"] = peaks
    data["measured_on"] = measurement.description
    return data


def calibration_header(command: str, base_path: str, base: dict, measurement: DeviceMeasurement,
                       device_type: str) -> str:
    """The written file's comment: how it was made, which figures were measured (with each GEMM's best and median
    rate) and which came from the base."""
    copied = sorted(key for key in base if key not in (*MEASURED_KEYS, "name", "measured_on"))
    lines = [f"Written by {command} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}) on "
             f"{measurement.description}; how: xscale/bench/device_calibration.py.",
             f"Measured here: peak_tflops (the best GEMM rate per dtype), gemm_efficiency ({curve_dtype(device_type)}'s "
             f"best rate per s over the peak), attention_efficiency (causal SDPA forward + backward in "
             f"{curve_dtype(device_type)}, best rate over that peak), memory_bandwidth_gbs (a {measurement.copy_bytes // 2**20} MiB copy, "
             f"best), memory_gib (the device's total memory), device (its kind).",
             f"From the base {base_path} (not measurable on one device, or not measured by this path): "
             f"{', '.join(copied)}.",
             f"GEMM (rows {GEMM_ROWS} x s) @ (s x s), TFLOP/s best / median of the timings:"]
    for dtype, timings in measurement.gemms.items():
        lines.append(f"  {dtype}: " + ", ".join(f"s={t.size} {t.best_rate / 1e12:.4g} / {t.median_rate / 1e12:.4g}"
                                                for t in timings))
    return "".join(f"# {line}\n" for line in lines)


def read_base(path: str) -> dict:
    """The base cluster file's mapping, checked by the cluster loader first (a :class:`ClusterError` naming it)."""
    load_cluster(path)
    return yaml.safe_load(Path(path).read_text())


def write_device_calibration(path: str | Path, device_name: str, base_path: str, quick: bool) -> tuple[dict, str]:
    """Measure ``device_name`` and write the base with the measured figures; returns (the mapping, the header).
    Raises :class:`~xscale.estimate.cluster.ClusterError` for a bad base and :class:`DeviceUnavailable` for a device torch cannot use."""
    base = read_base(base_path)
    device = resolve_device(device_name)
    measurement = measure_device(device, int(base["devices_per_node"]), quick)
    data = device_cluster(base, measurement, device.type)
    command = (f"xscale plan --calibrate {path} --device {device_name} --base {base_path}"
               f"{' --quick' if quick else ''}")
    header = calibration_header(command, base_path, base, measurement, device.type)
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return data, header

