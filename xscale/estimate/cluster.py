"""A cluster description: what the cost model (:mod:`~xscale.estimate.step_time`) knows of the hardware.

One YAML file (presets in ``configs/clusters/``) gives, per device: its memory and memory bandwidth, its peak
FLOP/s per dtype and the share of that peak a GEMM reaches by its smallest dimension (a piecewise-linear curve);
and, per link (``intra_node``: between devices of one node, ``inter_node``: between nodes) and per collective
(all_reduce, all_gather, reduce_scatter, all_to_all, send_recv), a latency and a bus bandwidth in the sense of
NCCL's tests (``busbw``: the rate that makes time = latency term + ring factor x bytes / busbw,
:mod:`~xscale.estimate.communication`). Every figure is checked when the file is read; a missing, negative or
ill-typed one is a :class:`ClusterError` naming the key and the file.

Two optional figures describe a machine rather than a device: ``runtime_memory_mib``, what each process holds
besides its tensors (allocator, thread pools, the process group's buffers: measured by ``xscale plan --calibrate``;
0 if absent), added to every predicted peak; and ``concurrent_devices``, how many of a node's devices compute at
full rate at once (a CPU node's cores when processes outnumber them; default ``devices_per_node``):
:meth:`Cluster.compute_share`.

Five optional figures describe the framework's own costs on the device (all measured by ``xscale plan
--calibrate``, :mod:`xscale.estimate.overheads` uses them): ``elementwise_bandwidth_gbs``, the rate at which eager
norms, activations, residual adds and softmax move their saved activations (default ``memory_bandwidth_gbs``);
``loss_ns_per_logit``, the cross-entropy's softmax work per logit, forward and backward (default 0);
``block_overhead_us``, the fixed (size-independent) time of one block's forward and backward: operator dispatch
and autograd bookkeeping (default 0); ``step_overhead_ms``, the same for one step outside the blocks (default 0);
and ``tensor_parallel``, the all_reduce / all_gather / reduce_scatter figures of tensor parallelism's
redistributions as the implementation issues them (DTensor on top of the process group; default the link's).
One optional compute figure: ``attention_efficiency``, the share of the peak the attention core (SDPA, causal,
forward + backward) reaches, as a grid of [head dimension, keys per query, fraction] points measured by ``xscale
plan --calibrate`` (:meth:`Cluster.attention_fraction`; default: the GEMM curve at min(head dimension, keys)).
One optional memory figure: ``collective_buffers``, per collective (all_reduce, all_gather, reduce_scatter) the
bytes a process holds for the collective's working buffers per byte of its message (gloo's CPU algorithms;
:mod:`xscale.estimate.collective_memory`; default 0).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xscale.config.schema import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TENSOR_PARALLEL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
LINKS = ("intra_node", "inter_node")
DTYPES = ("bf16", "fp32")


class ClusterError(ConfigError):
    """A cluster file that cannot describe a cluster; the message names the key and the file."""


@dataclass(frozen=True)
class LinkCost:
    """One collective on one link: ``latency_s`` per algorithm step, ``bandwidth`` bus bytes per second."""

    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class Cluster:
    """Devices per node, per-device memory (bytes) and bandwidth (bytes/s), peak FLOP/s per dtype, the GEMM
    efficiency curve ((smallest dimension, fraction of peak) points, ascending) and the link costs."""

    name: str
    devices_per_node: int
    memory_bytes: float
    memory_bandwidth: float
    peak_flops: dict[str, float]
    gemm_efficiency: tuple[tuple[float, float], ...]
    links: dict[str, dict[str, LinkCost]]
    device: str = "gpu"  # gpu | cpu: what ``xscale plan --emit`` launches (launch.gpus_per_node or CPU processes)
    runtime_memory_bytes: float = 0.0  # per process, besides its tensors (module docstring)
    concurrent_devices: int = 0  # devices of a node computing at full rate at once; 0: devices_per_node
    elementwise_bandwidth_bytes: float = 0.0  # bytes/s of eager memory-bound ops; 0: memory_bandwidth
    loss_seconds_per_logit: float = 0.0
    block_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    tensor_parallel: tuple[tuple[str, LinkCost], ...] = ()  # (collective, cost) of tp's redistributions
    collective_buffers: tuple[tuple[str, float], ...] = ()  # (collective, bytes held per message byte)
    attention_efficiency: tuple[tuple[float, float, float], ...] = ()  # (head dim, keys, fraction) grid; (): GEMMs'

    @property
    def elementwise_bandwidth(self) -> float:
        return self.elementwise_bandwidth_bytes or self.memory_bandwidth

    def tensor_parallel_link(self, spans_nodes: bool, collective: str) -> LinkCost:
        """Tensor parallelism's cost of ``collective``: the calibrated redistribution's within a node, else the
        link's."""
        measured = dict(self.tensor_parallel)
        return measured[collective] if collective in measured and not spans_nodes else self.link(spans_nodes,
                                                                                                  collective)

    def compute_share(self, world_size: int) -> float:
        """The share of a device's rate each of a layout's processes gets: concurrent devices / the processes on
        one node (min(world, devices per node)), at most 1. A GPU node's devices never share; 4 processes on a
        2-core CPU node get 1/2 each."""
        concurrent = self.concurrent_devices or self.devices_per_node
        return min(1.0, concurrent / min(world_size, self.devices_per_node))

    def efficiency(self, smallest_dimension: float) -> float:
        """The fraction of peak a GEMM whose smallest dimension is ``smallest_dimension`` reaches: linear between
        the curve's points, flat beyond its ends."""
        return piecewise_linear(self.gemm_efficiency, smallest_dimension)

    def attention_fraction(self, head_dim: float, keys: float) -> float:
        """The fraction of peak the attention core reaches with ``head_dim`` and ``keys`` per query: bilinear in
        the calibrated grid (flat beyond its ends), else the GEMM curve at min(head_dim, keys)."""
        if not self.attention_efficiency:
            return self.efficiency(min(head_dim, keys))
        rows: dict[float, list[tuple[float, float]]] = {}
        for dim, key_count, fraction in self.attention_efficiency:
            rows.setdefault(dim, []).append((key_count, fraction))
        return piecewise_linear(tuple((dim, piecewise_linear(tuple(sorted(row)), keys))
                                      for dim, row in sorted(rows.items())), head_dim)

    def link(self, spans_nodes: bool, collective: str) -> LinkCost:
        return self.links["inter_node" if spans_nodes else "intra_node"][collective]


def piecewise_linear(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The value at ``x`` of the curve through ``points`` (ascending x): linear between them, flat beyond its ends."""
    index = bisect.bisect_left([point for point, _ in points], x)
    if index == 0:
        return points[0][1]
    if index == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class _Reader:
    """Reads typed, checked figures out of the loaded YAML, naming ``source`` and the dotted key in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> ClusterError:
        return ClusterError(f"cluster file {self.source}: {key} {problem}")

    def mapping(self, data: dict, key: str, path: str = "") -> dict:
        if key not in data:
            raise self.fail(f"{path}{key}", "is missing")
        if not isinstance(data[key], dict):
            raise self.fail(f"{path}{key}", f"must be a mapping, got {data[key]!r}")
        return data[key]

    def number(self, data: dict, key: str, path: str, positive: bool = True) -> float:
        if key not in data:
            raise self.fail(f"{path}{key}", "is missing")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{path}{key}", f"must be a number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise self.fail(f"{path}{key}", f"must be {'positive' if positive else 'non-negative'}, got {value}")
        return float(value)


def cluster_from_dict(data: Any, source: str = "<dict>") -> Cluster:
    """A :class:`Cluster` from the loaded YAML (units in the file: GiB, GB/s, TFLOP/s, microseconds)."""
    reader = _Reader(source)
    if not isinstance(data, dict):
        raise reader.fail("the top level", f"must be a mapping, got {type(data).__name__}")
    devices = reader.number(data, "devices_per_node", "")
    if devices != int(devices):
        raise reader.fail("devices_per_node", f"must be a whole number, got {devices}")
    peaks = reader.mapping(data, "peak_tflops")
    curve = data.get("gemm_efficiency")
    if not isinstance(curve, list) or not curve:
        raise reader.fail("gemm_efficiency", "must be a non-empty list of [smallest dimension, fraction] points")
    points = []
    for index, point in enumerate(curve):
        if not isinstance(point, list | tuple) or len(point) != 2:
            raise reader.fail(f"gemm_efficiency[{index}]", f"must be a [smallest dimension, fraction] pair, got {point!r}")
        pair = dict(zip(("dimension", "fraction"), point))
        dimension = reader.number(pair, "dimension", f"gemm_efficiency[{index}].")
        fraction = reader.number(pair, "fraction", f"gemm_efficiency[{index}].")
        if fraction > 1:
            raise reader.fail(f"gemm_efficiency[{index}].fraction", f"must be at most 1, got {fraction}")
        points.append((dimension, fraction))
    if [size for size, _ in points] != sorted({size for size, _ in points}):
        raise reader.fail("gemm_efficiency", "dimensions must be strictly ascending")
    links_data = reader.mapping(data, "links")
    links = {link: _link_costs(reader, reader.mapping(links_data, link, "links."), f"links.{link}.", COLLECTIVES)
             for link in LINKS}
    tensor_parallel = (_link_costs(reader, reader.mapping(data, "tensor_parallel"), "tensor_parallel.",
                                   TENSOR_PARALLEL_COLLECTIVES) if "tensor_parallel" in data else {})
    return Cluster(
        name=str(data.get("name", Path(source).stem)),
        devices_per_node=int(devices),
        memory_bytes=reader.number(data, "memory_gib", "") * 2**30,
        memory_bandwidth=reader.number(data, "memory_bandwidth_gbs", "") * 1e9,
        peak_flops={dtype: reader.number(peaks, dtype, "peak_tflops.") * 1e12 for dtype in DTYPES},
        gemm_efficiency=tuple(points),
        links=links,
        device=_device(reader, data),
        runtime_memory_bytes=(reader.number(data, "runtime_memory_mib", "", positive=False) * 2**20
                              if "runtime_memory_mib" in data else 0.0),
        concurrent_devices=_concurrent_devices(reader, data, int(devices)),
        elementwise_bandwidth_bytes=_optional(reader, data, "elementwise_bandwidth_gbs", 1e9, positive=True),
        loss_seconds_per_logit=_optional(reader, data, "loss_ns_per_logit", 1e-9),
        block_overhead_s=_optional(reader, data, "block_overhead_us", 1e-6),
        step_overhead_s=_optional(reader, data, "step_overhead_ms", 1e-3),
        tensor_parallel=tuple(tensor_parallel.items()),
        collective_buffers=_collective_buffers(reader, data),
        attention_efficiency=_attention_grid(reader, data),
    )


def _attention_grid(reader: _Reader, data: dict) -> tuple[tuple[float, float, float], ...]:
    """``attention_efficiency``: [head dim, keys, fraction] points covering every head dim x keys pair once."""
    if "attention_efficiency" not in data:
        return ()
    grid = data["attention_efficiency"]
    if not isinstance(grid, list) or not grid:
        raise reader.fail("attention_efficiency", "must be a non-empty list of [head dim, keys, fraction] points")
    points = []
    for index, point in enumerate(grid):
        if not isinstance(point, list | tuple) or len(point) != 3:
            raise reader.fail(f"attention_efficiency[{index}]", f"must be a [head dim, keys, fraction] triple, "
                                                                 f"got {point!r}")
        triple = dict(zip(("head_dim", "keys", "fraction"), point))
        figures = tuple(reader.number(triple, key, f"attention_efficiency[{index}].") for key in triple)
        if figures[2] > 1:
            raise reader.fail(f"attention_efficiency[{index}].fraction", f"must be at most 1, got {figures[2]}")
        points.append(figures)
    dims, keys = sorted({dim for dim, _, _ in points}), sorted({key for _, key, _ in points})
    if sorted((dim, key) for dim, key, _ in points) != [(dim, key) for dim in dims for key in keys]:
        raise reader.fail("attention_efficiency", f"must have one point for every head dim {dims} and keys {keys}")
    return tuple(sorted(points))


def _collective_buffers(reader: _Reader, data: dict) -> tuple[tuple[str, float], ...]:
    if "collective_buffers" not in data:
        return ()
    ratios = reader.mapping(data, "collective_buffers")
    return tuple((collective, reader.number(ratios, collective, "collective_buffers.", positive=False))
                 for collective in TENSOR_PARALLEL_COLLECTIVES)


def _link_costs(reader: _Reader, per_collective: dict, path: str, collectives: tuple[str, ...]) -> dict[str, LinkCost]:
    costs = {}
    for collective in collectives:
        figures = reader.mapping(per_collective, collective, path)
        costs[collective] = LinkCost(
            latency_s=reader.number(figures, "latency_us", f"{path}{collective}.", positive=False) * 1e-6,
            bandwidth=reader.number(figures, "bandwidth_gbs", f"{path}{collective}.") * 1e9)
    return costs


def _optional(reader: _Reader, data: dict, key: str, unit: float, positive: bool = False) -> float:
    """An optional figure in SI units (0 when absent); present, it is checked like every other."""
    return reader.number(data, key, "", positive=positive) * unit if key in data else 0.0


def _concurrent_devices(reader: _Reader, data: dict, devices: int) -> int:
    if "concurrent_devices" not in data:
        return 0
    value = reader.number(data, "concurrent_devices", "")
    if value != int(value) or value > devices:
        raise reader.fail("concurrent_devices", f"must be a whole number at most devices_per_node ({devices}), "
                                                f"got {value:g}")
    return int(value)


def _device(reader: _Reader, data: dict) -> str:
    device = data.get("device", "gpu")
    if device not in ("gpu", "cpu"):
        raise reader.fail("device", f"must be gpu or cpu, got {device!r}")
    return device


def load_cluster(path: str | Path) -> Cluster:
    """Read and check a cluster file (module docstring)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ClusterError(f"cluster file {path}: cannot be read ({error.strerror or error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ClusterError(f"cluster file {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    return cluster_from_dict(data, str(path))


def cluster_to_dict(cluster: Cluster) -> dict:
    """The YAML form of ``cluster`` (what :func:`cluster_from_dict` reads), e.g. for a calibrated file."""
    extra: dict[str, float] = {}
    if cluster.runtime_memory_bytes:
        extra["runtime_memory_mib"] = cluster.runtime_memory_bytes / 2**20
    if cluster.concurrent_devices:
        extra["concurrent_devices"] = cluster.concurrent_devices
    for key, value, unit in (("elementwise_bandwidth_gbs", cluster.elementwise_bandwidth_bytes, 1e9),
                             ("loss_ns_per_logit", cluster.loss_seconds_per_logit, 1e-9),
                             ("block_overhead_us", cluster.block_overhead_s, 1e-6),
                             ("step_overhead_ms", cluster.step_overhead_s, 1e-3)):
        if value:
            extra[key] = value / unit
    if cluster.collective_buffers:
        extra["collective_buffers"] = dict(cluster.collective_buffers)
    if cluster.attention_efficiency:
        extra["attention_efficiency"] = [list(point) for point in cluster.attention_efficiency]
    if cluster.tensor_parallel:
        extra["tensor_parallel"] = {collective: {"latency_us": cost.latency_s * 1e6,
                                                 "bandwidth_gbs": cost.bandwidth / 1e9}
                                    for collective, cost in cluster.tensor_parallel}
    return {
        "name": cluster.name,
        "device": cluster.device,
        "devices_per_node": cluster.devices_per_node,
        "memory_gib": cluster.memory_bytes / 2**30,
        "memory_bandwidth_gbs": cluster.memory_bandwidth / 1e9,
        "peak_tflops": {dtype: value / 1e12 for dtype, value in cluster.peak_flops.items()},
        "gemm_efficiency": [[size, fraction] for size, fraction in cluster.gemm_efficiency],
        "links": {link: {collective: {"latency_us": cost.latency_s * 1e6, "bandwidth_gbs": cost.bandwidth / 1e9}
                         for collective, cost in per_collective.items()}
                  for link, per_collective in cluster.links.items()},
        **extra,
    }
