"""One device's calibration (:mod:`xscale.bench.device_calibration`): the measured figures replace the base's, the
rest of the base is kept, and devices torch cannot use are refused clearly."""

from __future__ import annotations

import pytest
import torch
import yaml

from xscale.bench.device_calibration import (
    DeviceMeasurement,
    DeviceUnavailable,
    GemmTimings,
    calibration_header,
    device_cluster,
    resolve_device,
    time_calls,
)
from xscale.estimate.cluster import cluster_from_dict

H200 = "configs/clusters/h200-ib.yaml"


def _measurement() -> DeviceMeasurement:
    """Synthetic timings: bf16 reaches 4x fp32, the best timing of each shape its first."""
    gemms = {dtype: tuple(GemmTimings(size, tuple(scale * 2 * 2048 * size * size / rate for rate in
                                                   (100e12 * size / 1024, 80e12 * size / 1024, 90e12 * size / 1024)))
                          for size in (256, 512, 1024))
             for dtype, scale in (("bf16", 1.0), ("fp32", 4.0))}
    attention = ((64.0, 512.5, 40e12), (64.0, 2048.5, 60e12), (128.0, 512.5, 50e12), (128.0, 2048.5, 70e12))
    return DeviceMeasurement(gemms, 3.5e12, 2**30, 140e9, "a test device", attention)


def test_measured_figures_replace_the_base_and_the_rest_is_kept():
    base = yaml.safe_load(open(H200).read())
    data = device_cluster(base, _measurement(), "cuda")
    cluster = cluster_from_dict(data)
    assert data["peak_tflops"] == {"bf16": pytest.approx(100.0), "fp32": pytest.approx(25.0)}  # the best rates
    assert [fraction for _, fraction in data["gemm_efficiency"]] == [0.25, 0.5, 1.0]  # bf16's curve
    assert cluster.memory_bandwidth == pytest.approx(3.5e12, rel=1e-3)
    assert cluster.memory_bytes == pytest.approx(140e9, rel=1e-3)
    assert data["links"] == base["links"] and data["devices_per_node"] == base["devices_per_node"]
    assert cluster.device == "gpu" and data["name"] == "h200-ib-calibrated"
    # the attention core's rates over bf16's peak (100 TFLOP/s)
    assert data["attention_efficiency"] == [[64.0, 512.5, 0.4], [64.0, 2048.5, 0.6], [128.0, 512.5, 0.5],
                                            [128.0, 2048.5, 0.7]]
    assert cluster.attention_fraction(96, 1280.5) == pytest.approx(0.55)


def test_header_lists_measured_and_base_figures_with_medians():
    base = yaml.safe_load(open(H200).read())
    header = calibration_header("xscale plan --calibrate x.yaml", H200, base, _measurement(), "cuda")
    assert all(line.startswith("# ") for line in header.splitlines())
    assert f"From the base {H200}" in header and "devices_per_node, links." in header
    assert "bf16: s=256 25 / 22.5" in header  # best / median TFLOP/s


def test_time_calls_on_a_synchronized_device():
    seconds = time_calls(lambda: torch.ones(4, device="meta") * 2, torch.device("meta"), 2)
    assert len(seconds) == 2 and all(value > 0 for value in seconds)


@pytest.mark.parametrize("name, problem", [("cuda:0", "torch sees no cuda device"), ("bogus", "is not a torch device")])
def test_unusable_devices_are_refused(monkeypatch, name, problem):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match=problem):
        resolve_device(name)
