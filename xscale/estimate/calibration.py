"""Turning measurements of one machine into a cluster file (:mod:`~xscale.estimate.cluster`): the fits behind
``xscale plan --calibrate`` (the measuring is :mod:`xscale.bench.calibrate`).

* GEMM curve: the peak is the best measured rate; each measured smallest dimension's point is its rate / peak.
* Attention (:func:`attention_grid`): each measured (head dim, keys) point's SDPA rate / the fp32 peak.
* Collectives: each collective's samples (ranks n, bytes, seconds) are fitted to the alpha-beta model of
  :mod:`~xscale.estimate.communication`, time = latency x steps(n) + factor(n) x bytes / busbw, by least squares on
  the relative error (weights 1 / time^2, so a 4 KiB call counts as much as a 16 MiB one), two unknowns:
  latency and 1 / busbw. A negative solution of either is clamped to its smallest positive value and the other
  refitted alone.
* Tensor parallelism's redistributions (all-reduce, all-gather, reduce-scatter as DTensor issues them): the same
  alpha-beta fit, written as the file's ``tensor_parallel`` figures.
* Memory-bound ops (:func:`fit_elementwise_bandwidth`): samples (saved bytes A, forward + backward seconds t) of a
  chain of eager norms, activations, residual adds and softmax, fitted to t = o + 3 A / B_e (o a fixed cost, B_e
  the elementwise bandwidth) by the same weighted least squares.
* The loss (:func:`loss_seconds_per_logit`): the fused linear cross-entropy's forward + backward over N x V logits
  of a narrow hidden width, less its three GEMMs timed alone on the same shapes, per logit.
* Dispatch (:func:`fit_dispatch`): a tiny model's step seconds (every tensor a few KiB, so the time is fixed cost)
  at two depths L1 < L2: per block o_b = (t2 - t1) / (L2 - L1), per step o_s = t1 - L1 o_b (each at least 0).
* Collective working buffers: bytes per message byte, written as measured (``collective_buffers``).
* One node: ``inter_node`` repeats ``intra_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from xscale.estimate.cluster import COLLECTIVES, DTYPES, LINKS, TENSOR_PARALLEL_COLLECTIVES
from xscale.estimate.communication import bandwidth_factor, latency_steps
from xscale.estimate.overheads import ELEMENTWISE_PASSES

SMALLEST_BANDWIDTH = 1e6  # bytes/s: a fit that finds no bandwidth term at all


@dataclass(frozen=True)
class CollectiveSample:
    """One measured collective: ``seconds`` (median) of one call over ``ranks`` ranks moving ``size_bytes`` (the
    bytes :func:`~xscale.estimate.communication.collective_seconds` takes: the whole gathered / scattered buffer,
    the all-reduced buffer, all one rank sends in an all-to-all, the message)."""

    collective: str
    ranks: int
    size_bytes: float
    seconds: float


def fit_alpha_beta(samples: list[CollectiveSample]) -> tuple[float, float]:
    """(latency seconds per step, bus bandwidth bytes/s) of one collective's samples (module docstring)."""
    rows = [(latency_steps(s.collective, s.ranks), bandwidth_factor(s.collective, s.ranks) * s.size_bytes,
             s.seconds) for s in samples if s.ranks > 1 and s.seconds > 0]
    if not rows:
        raise ValueError("no samples over 2 or more ranks to fit")
    return _fit_fixed_and_rate(rows)


def fit_elementwise_bandwidth(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds o, bytes/s B_e) of t = o + 3 A / B_e over (saved bytes A, seconds t) samples (module
    docstring)."""
    rows = [(1.0, ELEMENTWISE_PASSES * saved, seconds) for saved, seconds in samples if seconds > 0]
    if len(rows) < 2:
        raise ValueError("need at least two elementwise samples to fit")
    return _fit_fixed_and_rate(rows)


def loss_seconds_per_logit(seconds: float, gemm_seconds: float, logits: int) -> float:
    """The loss's softmax seconds per logit: (t - t_GEMMs) / (N V), at least 0 (module docstring)."""
    return max(0.0, seconds - gemm_seconds) / logits


def fit_dispatch(step_seconds: dict[int, float]) -> tuple[float, float]:
    """(per block o_b, per step o_s) seconds from a tiny model's step seconds at two depths (module docstring)."""
    if len(step_seconds) != 2:
        raise ValueError(f"need the step at exactly two depths, got {sorted(step_seconds)}")
    (shallow, t1), (deep, t2) = sorted(step_seconds.items())
    per_block = max(0.0, (t2 - t1) / (deep - shallow))
    return per_block, max(0.0, t1 - shallow * per_block)


def _fit_fixed_and_rate(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of t = a x + c y on the relative error over (a, c, t) rows: (x >= 0, 1 / y > 0), a negative
    solution of either clamped (the other refitted alone)."""
    # weighted normal equations of t = a x + c y, weight 1 / t^2: [sum w a a, sum w a c; sum w a c, sum w c c]
    saa = sum(a * a / t**2 for a, _, t in rows)
    sac = sum(a * c / t**2 for a, c, t in rows)
    scc = sum(c * c / t**2 for _, c, t in rows)
    sat = sum(a / t for a, _, t in rows)
    sct = sum(c / t for _, c, t in rows)
    determinant = saa * scc - sac * sac
    latency = inverse_bandwidth = -1.0
    if determinant > 1e-12 * saa * scc:
        latency = (sat * scc - sac * sct) / determinant
        inverse_bandwidth = (saa * sct - sac * sat) / determinant
    if inverse_bandwidth <= 0:  # no bandwidth term in the samples: latency alone
        inverse_bandwidth = 1 / SMALLEST_BANDWIDTH if scc == 0 else 0.0
        latency = sat / saa
    elif latency < 0:  # bandwidth alone
        latency, inverse_bandwidth = 0.0, sct / scc
    bandwidth = 1 / inverse_bandwidth if inverse_bandwidth > 0 else 1e15
    return max(latency, 0.0), bandwidth


def gemm_curve(rates: dict[int, float]) -> tuple[float, list[list[float]]]:
    """(peak FLOP/s, [[smallest dimension, rate / peak], ...] ascending) from FLOP/s by smallest dimension."""
    if not rates:
        raise ValueError("no GEMM rates to fit")
    peak = max(rates.values())
    # 4 significant figures, not decimals: a launch-bound GPU GEMM at s = 16 reaches ~1e-4 of the peak, never 0
    return peak, [[float(size), float(f"{rates[size] / peak:.4g}")] for size in sorted(rates)]


@dataclass(frozen=True)
class FrameworkCosts:
    """The framework's own costs on one device (:mod:`~xscale.estimate.overheads`), in SI units: elementwise
    bandwidth (bytes/s), loss seconds per logit, dispatch seconds per block and per step, and tensor parallelism's
    redistribution samples."""

    elementwise_bandwidth: float
    loss_seconds_per_logit: float
    block_overhead: float
    step_overhead: float
    tensor_parallel: tuple[CollectiveSample, ...] = ()

    def figures(self) -> dict:
        """The cluster file's keys for these costs."""
        data: dict = {"elementwise_bandwidth_gbs": round(self.elementwise_bandwidth / 1e9, 4),
                      "loss_ns_per_logit": round(self.loss_seconds_per_logit * 1e9, 4),
                      "block_overhead_us": round(self.block_overhead * 1e6, 2),
                      "step_overhead_ms": round(self.step_overhead * 1e3, 3)}
        if self.tensor_parallel:
            data["tensor_parallel"] = {}
            for collective in TENSOR_PARALLEL_COLLECTIVES:
                latency, bandwidth = fit_alpha_beta([s for s in self.tensor_parallel if s.collective == collective])
                data["tensor_parallel"][collective] = {"bandwidth_gbs": round(bandwidth / 1e9, 6),
                                                       "latency_us": round(latency * 1e6, 3)}
        return data


def attention_grid(rates: list[tuple[float, float, float]], peak: float) -> list[list[float]]:
    """The ``attention_efficiency`` grid: each (head dim, keys, FLOP/s) point's rate over ``peak`` (the GEMM peak of
    the dtype it was measured in), at most 1."""
    return [[head_dim, keys, round(min(1.0, rate / peak), 4)] for head_dim, keys, rate in sorted(rates)]


def calibrated_cluster(name: str, processes: int, concurrent: int, memory_bytes: float, memory_bandwidth: float,
                       gemm_rates: dict[str, dict[int, float]], samples: list[CollectiveSample],
                       runtime_memory_bytes: float, comment_source: str = "",
                       framework: FrameworkCosts | None = None,
                       collective_buffers: dict[str, float] | None = None,
                       attention_rates: list[tuple[float, float, float]] | None = None) -> dict:
    """The cluster file's mapping (:func:`xscale.estimate.cluster.cluster_from_dict`'s units) of a one-node CPU
    machine of ``processes`` devices measured as described in the module docstring; ``gemm_rates`` per dtype,
    ``attention_rates`` (head dim, keys, fp32 FLOP/s) points.
    gloo has no reduce-scatter of its own on CPU tensors: a collective without samples takes the all-reduce's fit."""
    peaks, curve = {}, None
    for dtype in DTYPES:
        peak, points = gemm_curve(gemm_rates[dtype])
        peaks[dtype] = peak / 1e12
        if dtype == "fp32":  # xscale's CPU default precision
            curve = points
    fitted = {}
    for collective in COLLECTIVES:
        own = [sample for sample in samples if sample.collective == collective]
        if own:
            fitted[collective] = fit_alpha_beta(own)
    if "all_reduce" not in fitted:
        raise ValueError("no all_reduce samples: every collective without samples takes its fit")
    link = {collective: {"bandwidth_gbs": round(fitted.get(collective, fitted["all_reduce"])[1] / 1e9, 6),
                         "latency_us": round(fitted.get(collective, fitted["all_reduce"])[0] * 1e6, 3)}
            for collective in COLLECTIVES}
    data = {
        "name": name,
        "device": "cpu",
        "devices_per_node": processes,
        "concurrent_devices": min(concurrent, processes),
        "memory_gib": round(memory_bytes / 2**30, 3),
        "memory_bandwidth_gbs": round(memory_bandwidth / 1e9, 3),
        "runtime_memory_mib": round(runtime_memory_bytes / 2**20, 2),
        "peak_tflops": {dtype: round(value, 6) for dtype, value in peaks.items()},
        "gemm_efficiency": curve,
        "links": {name_: {collective: dict(figures) for collective, figures in link.items()} for name_ in LINKS},
        **(framework.figures() if framework else {}),
        **({"collective_buffers": dict(collective_buffers)} if collective_buffers else {}),
        **({"attention_efficiency": attention_grid(attention_rates, peaks["fp32"] * 1e12)} if attention_rates else {}),
    }
    if comment_source:
        data["measured_on"] = comment_source
    return data
