"""Cluster files (:mod:`xscale.estimate.cluster`): the presets load, the GEMM curve interpolates, and every bad
figure is one error naming the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xscale.estimate.cluster import ClusterError, cluster_from_dict, cluster_to_dict, load_cluster

PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs" / "clusters").glob("*.yaml"))


def _figures() -> dict:
    link = {name: {"bandwidth_gbs": 100, "latency_us": 2} for name in
            ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")}
    return {"name": "test", "devices_per_node": 8, "memory_gib": 80, "memory_bandwidth_gbs": 2000,
            "peak_tflops": {"bf16": 100, "fp32": 10}, "gemm_efficiency": [[100, 0.2], [300, 0.6]],
            "links": {"intra_node": link, "inter_node": dict(link)}}


@pytest.mark.parametrize("path", PRESETS, ids=lambda path: path.stem)
def test_presets_load(path):
    cluster = load_cluster(path)
    assert cluster.devices_per_node >= 1 and cluster.peak_flops["bf16"] > 0
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster


def test_presets_include_gpus_and_this_machine():
    assert {"h100-ib", "a100-ib", "cpu-2core"} <= {path.stem for path in PRESETS}


def test_units_and_efficiency_curve():
    cluster = cluster_from_dict(_figures())
    assert cluster.memory_bytes == 80 * 2**30 and cluster.peak_flops["bf16"] == 100e12
    assert cluster.link(True, "all_gather").latency_s == pytest.approx(2e-6)
    assert cluster.link(False, "send_recv").bandwidth == 100e9
    # flat beyond the ends, linear between points: 0.2 + (0.6 - 0.2) * (200 - 100) / (300 - 100) = 0.4
    assert cluster.efficiency(10) == 0.2 and cluster.efficiency(1000) == 0.6
    assert cluster.efficiency(200) == pytest.approx(0.4)


@pytest.mark.parametrize("edit, key", [
    (lambda f: f.pop("memory_gib"), "memory_gib is missing"),
    (lambda f: f.update(devices_per_node=-8), "devices_per_node must be positive"),
    (lambda f: f["peak_tflops"].update(bf16="fast"), "peak_tflops.bf16 must be a number"),
    (lambda f: f["links"]["inter_node"].pop("all_to_all"), "links.inter_node.all_to_all is missing"),
    (lambda f: f["links"]["intra_node"]["send_recv"].update(latency_us=-1),
     "links.intra_node.send_recv.latency_us must be non-negative"),
    (lambda f: f.update(gemm_efficiency=[[100, 1.5]]), "gemm_efficiency[0].fraction must be at most 1"),
    (lambda f: f.update(gemm_efficiency=[[300, 0.5], [100, 0.6]]), "gemm_efficiency dimensions must be"),
    (lambda f: f.pop("links"), "links is missing"),
])
def test_bad_figures_name_the_key_and_file(tmp_path, edit, key):
    figures = _figures()
    edit(figures)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(figures))
    with pytest.raises(ClusterError) as error:
        load_cluster(path)
    assert str(path) in str(error.value) and key in str(error.value)
    assert "\n" not in str(error.value)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ClusterError, match="cannot be read"):
        load_cluster(tmp_path / "absent.yaml")
    (tmp_path / "broken.yaml").write_text("links: [unclosed")
    with pytest.raises(ClusterError, match="not valid YAML"):
        load_cluster(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ClusterError, match="must be a mapping"):
        load_cluster(tmp_path / "list.yaml")


def test_machine_figures_optional_and_checked():
    figures = _figures()
    cluster = cluster_from_dict(figures)
    assert cluster.runtime_memory_bytes == 0 and cluster.compute_share(8) == 1.0
    figures.update({"runtime_memory_mib": 16, "concurrent_devices": 2})
    cluster = cluster_from_dict(figures)
    assert cluster.runtime_memory_bytes == 16 * 2**20
    # 2 cores: one or two processes compute at full rate, 4 get half each; beyond a node, still per node
    assert [cluster.compute_share(n) for n in (1, 2, 4, 8, 64)] == [1.0, 1.0, 0.5, 0.25, 0.25]
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    for key, value, problem in (("runtime_memory_mib", -1, "non-negative"), ("concurrent_devices", 9, "at most"),
                                ("concurrent_devices", 0, "positive")):
        with pytest.raises(ClusterError, match=f"{key} must be .*{problem}"):
            cluster_from_dict({**_figures(), key: value}, "bad.yaml")


def test_framework_figures_optional_checked_and_round_trip():
    cluster = cluster_from_dict(_figures())
    assert cluster.elementwise_bandwidth == cluster.memory_bandwidth and cluster.block_overhead_s == 0
    assert cluster.tensor_parallel_link(False, "all_gather") == cluster.link(False, "all_gather")
    tp = {name: {"bandwidth_gbs": 0.5, "latency_us": 700} for name in ("all_reduce", "all_gather", "reduce_scatter")}
    cluster = cluster_from_dict({**_figures(), "elementwise_bandwidth_gbs": 6, "loss_ns_per_logit": 1.5,
                                 "block_overhead_us": 1000, "step_overhead_ms": 2, "tensor_parallel": tp})
    assert cluster.elementwise_bandwidth == 6e9 and cluster.loss_seconds_per_logit == pytest.approx(1.5e-9)
    assert cluster.block_overhead_s == pytest.approx(1e-3) and cluster.step_overhead_s == pytest.approx(2e-3)
    # within a node tensor parallelism takes its own figures; across nodes (never searched) the link's
    assert cluster.tensor_parallel_link(False, "all_gather").latency_s == pytest.approx(700e-6)
    assert cluster.tensor_parallel_link(True, "all_gather") == cluster.link(True, "all_gather")
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    for key, value, problem in (("elementwise_bandwidth_gbs", 0, "positive"), ("block_overhead_us", -1, "non-negative"),
                                ("tensor_parallel", {"all_reduce": tp["all_reduce"]}, "is missing")):
        with pytest.raises(ClusterError, match=f"{key}.* (must be .*{problem}|{problem})"):
            cluster_from_dict({**_figures(), key: value}, "bad.yaml")


def test_collective_buffers_optional_and_checked():
    assert cluster_from_dict(_figures()).collective_buffers == ()
    ratios = {"all_reduce": 0.3, "all_gather": 1.0, "reduce_scatter": 1.0}
    cluster = cluster_from_dict({**_figures(), "collective_buffers": ratios})
    assert dict(cluster.collective_buffers) == ratios and cluster_from_dict(cluster_to_dict(cluster)) == cluster
    with pytest.raises(ClusterError, match="collective_buffers.all_gather must be non-negative"):
        cluster_from_dict({**_figures(), "collective_buffers": {**ratios, "all_gather": -1}}, "bad.yaml")


def test_attention_grid_optional_interpolated_and_checked():
    cluster = cluster_from_dict(_figures())
    assert cluster.attention_fraction(64, 512) == cluster.efficiency(64)  # no grid: the GEMM curve at min(d, keys)
    grid = [[32, 64, 0.2], [32, 512, 0.4], [64, 64, 0.3], [64, 512, 0.6]]
    cluster = cluster_from_dict({**_figures(), "attention_efficiency": grid})
    assert cluster.attention_fraction(32, 64) == pytest.approx(0.2)
    # keys halfway at both head dims (0.3 and 0.45), then halfway between the head dims
    assert cluster.attention_fraction(48, 288) == pytest.approx(0.375)
    assert cluster.attention_fraction(8, 10) == pytest.approx(0.2) and cluster.attention_fraction(256, 1e5) == 0.6
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    for value, problem in (([[32, 64, 1.5]], r"attention_efficiency\[0\].fraction must be at most 1"),
                           ([[32, 64, -0.1]], r"attention_efficiency\[0\].fraction must be positive"),
                           ([[32, 64]], "must be a .head dim, keys, fraction. triple"),
                           ([], "must be a non-empty list"),
                           (grid[:3], "one point for every head dim")):
        with pytest.raises(ClusterError, match=problem):
            cluster_from_dict({**_figures(), "attention_efficiency": value}, "bad.yaml")
