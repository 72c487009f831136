"""The calibration's fits (:mod:`xscale.estimate.calibration`): alpha-beta parameters recovered from synthetic
timings, the GEMM curve, and a calibrated mapping that loads as a cluster and plans."""

from __future__ import annotations

import pytest

from xscale.config.load import load_config
from xscale.estimate.calibration import (
    CollectiveSample,
    FrameworkCosts,
    calibrated_cluster,
    fit_alpha_beta,
    fit_dispatch,
    fit_elementwise_bandwidth,
    gemm_curve,
    loss_seconds_per_logit,
)
from xscale.estimate.cluster import COLLECTIVES, cluster_from_dict
from xscale.estimate.communication import bandwidth_factor, latency_steps
from xscale.estimate.model_shape import model_shape
from xscale.estimate.search import search


def _timings(collective: str, latency: float, bandwidth: float, noise: float = 0.0) -> list[CollectiveSample]:
    samples = []
    for index, (ranks, size) in enumerate((r, s) for r in (2, 3, 4) for s in (4096, 2**16, 2**20, 2**23)):
        seconds = latency * latency_steps(collective, ranks) + bandwidth_factor(collective, ranks) * size / bandwidth
        samples.append(CollectiveSample(collective, ranks, size, seconds * (1 + noise * (-1) ** index)))
    return samples


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_alpha_beta_fit_recovers_latency_and_bandwidth(collective):
    latency, bandwidth = fit_alpha_beta(_timings(collective, 300e-6, 1.5e9))
    assert latency == pytest.approx(300e-6, rel=1e-6) and bandwidth == pytest.approx(1.5e9, rel=1e-6)


def test_alpha_beta_fit_tolerates_noise_and_clamps():
    latency, bandwidth = fit_alpha_beta(_timings("all_reduce", 300e-6, 1.5e9, noise=0.05))
    assert latency == pytest.approx(300e-6, rel=0.15) and bandwidth == pytest.approx(1.5e9, rel=0.15)
    # pure latency (every call the same time whatever its size): no negative bandwidth, latency kept
    flat = [CollectiveSample("send_recv", 2, size, 1e-3) for size in (4096, 2**20)]
    latency, bandwidth = fit_alpha_beta(flat)
    assert latency > 0 and bandwidth > 0
    # pure bandwidth: no negative latency
    latency, bandwidth = fit_alpha_beta(_timings("all_gather", 0.0, 2e9))
    assert latency == pytest.approx(0.0, abs=1e-9) and bandwidth == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta([CollectiveSample("all_reduce", 1, 4096, 1e-3)])


def test_gemm_curve_is_rate_over_best():
    peak, points = gemm_curve({256: 100e9, 64: 40e9, 1024: 80e9})
    assert peak == 100e9 and points == [[64.0, 0.4], [256.0, 1.0], [1024.0, 0.8]]
    _, points = gemm_curve({16: 0.2e12, 4096: 700e12})  # a launch-bound GPU GEMM: small, never rounded to 0
    assert points[0][1] == pytest.approx(0.2 / 700, rel=1e-3)


def test_calibrated_mapping_loads_and_plans():
    samples = [s for name in ("all_reduce", "all_gather", "all_to_all", "send_recv") for s in _timings(name, 1e-4, 1e9)]
    rates = {"fp32": {64: 30e9, 256: 90e9}, "bf16": {64: 60e9, 256: 200e9}}
    data = calibrated_cluster("here", 4, 2, 8 * 2**30, 20e9, rates, samples, 24 * 2**20)
    cluster = cluster_from_dict(data)
    assert cluster.concurrent_devices == 2 and cluster.runtime_memory_bytes == pytest.approx(24 * 2**20)
    assert cluster.peak_flops["fp32"] == pytest.approx(90e9)
    assert cluster.link(False, "reduce_scatter") == cluster.link(False, "all_reduce")  # no samples: the all-reduce's
    assert cluster.link(False, "all_gather").bandwidth == pytest.approx(1e9, rel=1e-4)
    config = load_config(overrides=["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                    "train.seq_len=16", "train.global_batch_size=4"])
    plans = search(model_shape(config), cluster, 4, top=1)
    assert plans[0].peak_bytes > 24 * 2**20  # the runtime's memory is part of every peak


def test_elementwise_bandwidth_fit_recovers_the_rate():
    # t = 50 us + 3 A / 6 GB/s over saved bytes 2.6, 10 and 42 MB
    samples = [(saved, 50e-6 + 3 * saved / 6e9) for saved in (2.6e6, 10e6, 42e6)]
    fixed, bandwidth = fit_elementwise_bandwidth(samples)
    assert fixed == pytest.approx(50e-6, rel=1e-6) and bandwidth == pytest.approx(6e9, rel=1e-6)
    with pytest.raises(ValueError, match="two elementwise samples"):
        fit_elementwise_bandwidth(samples[:1])


def test_loss_and_dispatch_fits():
    # 46 ms for the loss, 33 ms of it its GEMMs, over 2048 x 4096 logits
    assert loss_seconds_per_logit(0.046, 0.033, 2048 * 4096) == pytest.approx(0.013 / (2048 * 4096))
    assert loss_seconds_per_logit(0.030, 0.033, 100) == 0.0  # GEMMs timed slower than the whole: no negative cost
    # 1 block: 2.5 ms, 3 blocks: 5.1 ms -> 1.3 ms per block, 1.2 ms per step
    per_block, per_step = fit_dispatch({3: 5.1e-3, 1: 2.5e-3})
    assert per_block == pytest.approx(1.3e-3) and per_step == pytest.approx(1.2e-3)
    assert fit_dispatch({1: 3e-3, 3: 2e-3}) == (0.0, 3e-3)
    with pytest.raises(ValueError, match="two depths"):
        fit_dispatch({1: 1e-3})


def test_framework_costs_go_into_the_cluster_file():
    samples = _timings("all_reduce", 1e-4, 1e9)
    tp = [s for name in ("all_reduce", "all_gather", "reduce_scatter") for s in _timings(name, 7e-4, 0.5e9)]
    costs = FrameworkCosts(6e9, 1.5e-9, 1.1e-3, 1.5e-3, tuple(tp))
    rates = {"fp32": {64: 30e9, 256: 90e9}, "bf16": {64: 60e9, 256: 200e9}}
    cluster = cluster_from_dict(calibrated_cluster("here", 4, 2, 8 * 2**30, 20e9, rates, samples, 0, "", costs))
    assert cluster.elementwise_bandwidth == pytest.approx(6e9) and cluster.block_overhead_s == pytest.approx(1.1e-3)
    assert cluster.loss_seconds_per_logit == pytest.approx(1.5e-9) and cluster.step_overhead_s == pytest.approx(1.5e-3)
    reduce_scatter = cluster.tensor_parallel_link(False, "reduce_scatter")
    assert reduce_scatter.latency_s == pytest.approx(7e-4, rel=1e-4) and reduce_scatter.bandwidth == pytest.approx(
        0.5e9, rel=1e-4)
    assert cluster.link(False, "reduce_scatter").latency_s == pytest.approx(1e-4, rel=1e-4)


def test_attention_rates_become_a_grid_over_the_fp32_peak():
    samples = _timings("all_reduce", 1e-4, 1e9)
    rates = {"fp32": {64: 30e9, 256: 90e9}, "bf16": {64: 60e9, 256: 200e9}}
    attention = [(64, 64.5, 18e9), (32, 64.5, 9e9), (32, 512.5, 27e9), (64, 512.5, 99e9)]
    data = calibrated_cluster("here", 4, 2, 8 * 2**30, 20e9, rates, samples, 0, attention_rates=attention)
    assert data["attention_efficiency"] == [[32, 64.5, 0.1], [32, 512.5, 0.3], [64, 64.5, 0.2], [64, 512.5, 1.0]]
    assert cluster_from_dict(data).attention_fraction(32, 64.5) == pytest.approx(0.1)
    assert "attention_efficiency" not in calibrated_cluster("here", 4, 2, 8 * 2**30, 20e9, rates, samples, 0)
