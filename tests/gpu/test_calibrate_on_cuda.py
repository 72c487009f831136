"""``xscale plan --calibrate OUT --device cuda --base h200-ib.yaml`` on the GPU (:mod:`xscale.bench.device_calibration`):
the quick grid measured with CUDA events, the device's memory, a file the cluster loader reads with the base's
links."""

from pathlib import Path

import pytest
import torch
from gpu_checks import DEVICE, gpu

from xscale.cli import main
from xscale.estimate.cluster import load_cluster

pytestmark = gpu
BASE = str(Path(__file__).resolve().parents[2] / "configs" / "clusters" / "h200-ib.yaml")


def test_calibrate_the_device_against_the_h200_preset(tmp_path, capsys):
    out = tmp_path / "calibrated.yaml"
    assert main(["plan", "--calibrate", str(out), "--device", DEVICE, "--base", BASE, "--quick"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    written, base = load_cluster(out), load_cluster(BASE)
    assert written.links == base.links and written.devices_per_node == base.devices_per_node
    assert all(written.peak_flops[dtype] != base.peak_flops[dtype] for dtype in ("bf16", "fp32"))
    assert written.attention_efficiency and all(0 < point[2] <= 1 for point in written.attention_efficiency)
    if DEVICE == "cuda":
        assert written.device == "gpu"
        assert written.memory_bytes == pytest.approx(torch.cuda.get_device_properties(0).total_memory, rel=1e-3)
