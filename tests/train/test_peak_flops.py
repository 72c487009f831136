"""The MFU denominator: the best of several GEMM shapes, measured once per (torch, device, dtype, threads) and
cached. No test depends on real timings: a fake timer stands in for the matmuls."""

from __future__ import annotations

import json

import pytest
import torch

from xscale.train import peak_flops as peak
from xscale.train.peak_flops import best_gemm_flops, cache_key, peak_flops

SHAPES = ((100, 100, 100), (400, 100, 100), (100, 100, 50))


def test_the_peak_is_the_best_rate_over_the_shapes():
    seconds = {(100, 100, 100): 2e-3, (400, 100, 100): 4e-3, (100, 100, 50): 0.5e-3}  # 1e9, 2e9, 2e9 FLOP/s
    seconds[(400, 100, 100)] = 2.5e-3  # 2 * 4e6 / 2.5e-3 = 3.2e9: the best
    asked = []

    def fake(shape, dtype, device):
        asked.append((shape, dtype, device))
        return seconds[shape]

    assert best_gemm_flops(torch.bfloat16, "cpu", SHAPES, fake) == pytest.approx(3.2e9)
    assert asked == [(shape, torch.bfloat16, "cpu") for shape in SHAPES]  # every shape, in the dtype asked


def test_each_shape_is_timed_in_both_layouts_of_the_right_operand_and_the_faster_counts():
    """nn.Linear multiplies by W^T: a kernel that is slow for a row-major right operand and fast for a transposed one
    (bf16 on a CPU without native bf16) must not set the peak by the slow one."""
    seen = []

    def timer(a, b, device):
        seen.append((tuple(a.shape), tuple(b.shape), b.is_contiguous()))
        return 1.0 if b.is_contiguous() else 0.25

    assert peak.gemm_seconds((6, 4, 5), torch.float32, "cpu", timer) == 0.25
    assert seen == [((6, 4), (4, 5), True), ((6, 4), (4, 5), False)]


def test_measured_once_then_read_from_the_cache(tmp_path):
    path = tmp_path / "xscale" / "peak_flops.json"
    calls = []

    def measure(dtype, device):
        calls.append(dtype)
        return {torch.float32: 1e11, torch.bfloat16: 3e11}[dtype]

    assert peak_flops(torch.float32, "cpu", path, measure) == 1e11
    assert peak_flops(torch.float32, "cpu", path, measure) == 1e11
    assert peak_flops(torch.bfloat16, "cpu", path, measure) == 3e11  # each dtype its own entry
    assert calls == [torch.float32, torch.bfloat16]
    cached = json.loads(path.read_text())
    assert cached == {cache_key(torch.float32, "cpu"): 1e11, cache_key(torch.bfloat16, "cpu"): 3e11}


def test_the_key_names_torch_device_dtype_and_threads(monkeypatch):
    key = cache_key(torch.bfloat16, "cpu")
    assert torch.__version__ in key and "bfloat16" in key and f"x{torch.get_num_threads()} threads" in key
    assert key.endswith(f"| {peak.MEASUREMENT}")  # a value from the one-layout measurement is not read back
    monkeypatch.setattr(peak, "cpu_model", lambda: "Another CPU")
    assert cache_key(torch.bfloat16, "cpu") != key  # another machine measures again


def test_a_corrupt_or_unwritable_cache_is_measured_over(tmp_path):
    path = tmp_path / "peak_flops.json"
    path.write_text("{not json")
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 5e10) == 5e10
    assert json.loads(path.read_text()) == {cache_key(torch.float32, "cpu"): 5e10}
    blocked = tmp_path / "a_file" / "peak_flops.json"
    (tmp_path / "a_file").write_text("")  # its parent is a file: nothing can be written there
    assert peak_flops(torch.float32, "cpu", blocked, lambda dtype, device: 7e10) == 7e10
