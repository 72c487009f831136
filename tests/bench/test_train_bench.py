"""``xscale bench train``: the profiler breakdown's GEMM share, and one tiny run at bf16 with --profile."""

from __future__ import annotations

import pytest
import torch

from xscale.bench import train as bench_train
from xscale.bench.train import profile_breakdown, time_steps
from xscale.train.peak_flops import datasheet_flops_for, datasheet_peak_flops


def test_gemm_share_is_the_matmuls_part_of_the_op_time():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    top, share = profile_breakdown(lambda: [a @ b for _ in range(20)])
    assert top[0][0] == "aten::mm" and share > 0.9
    top, share = profile_breakdown(lambda: [torch.exp(a) for _ in range(20)])
    assert share == 0.0 and top[0][0] == "aten::exp"


@pytest.mark.slow
def test_bench_train_runs_both_models_at_bf16_and_profiles(capsys, monkeypatch):
    monkeypatch.setattr(bench_train, "bf16_warning", lambda precision, device: f"warned for {precision}")
    code = bench_train.main(["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "64", "--batch", "2",
                             "--seq", "16", "--steps", "2", "--precision", "bf16", "--peak-flops", "1e11", "--profile"])
    out = capsys.readouterr().out
    assert code == 0
    assert "warned for bf16" in out and "batch 2x16, bf16" in out and "100.0 GFLOP/s (given)" in out
    assert "ratio xscale / huggingface" in out and "matrix products (mm/addmm/bmm)" in out and "aten::" in out
    assert "per-round ratios: median" in out and "interquartile range" in out


def test_a_non_positive_peak_is_refused(capsys):
    assert bench_train.main(["--peak-flops", "0"]) == 2
    assert "--peak-flops 0.0 must be a positive" in capsys.readouterr().out


def test_datasheet_peaks_by_gpu_name():
    assert datasheet_flops_for("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert datasheet_flops_for("NVIDIA H100 80GB HBM3", torch.float32) == 66.9e12
    assert datasheet_flops_for("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert datasheet_flops_for("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert datasheet_flops_for("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert datasheet_flops_for("NVIDIA H100 80GB HBM3", torch.float16) is None
    assert datasheet_peak_flops(torch.bfloat16, "cpu") is None


def test_cuda_steps_are_synchronized_and_their_memory_kept(monkeypatch):
    calls = []
    allocated = iter(range(100, 10_000, 100))  # resident before each step, then its peak
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: next(allocated))
    runs = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times, memory = time_steps(runs, steps=2, warmup=3, device=torch.device("cuda"))
    assert calls[:6] == ["a", "b"] * 3 and calls[6:9] == ["sync", "a", "sync"]
    assert len(times["a"]) == len(times["b"]) == 2
    assert memory == {"a": (500, 600), "b": (700, 800)}
    assert time_steps(runs, steps=1, warmup=0, device=torch.device("cpu"))[1] == {}


def test_bench_train_on_cpu_reports_mfu_against_datasheet_and_measured_peaks(capsys, monkeypatch):
    monkeypatch.setattr(bench_train, "peak_flops", lambda dtype, device: 1e11)
    monkeypatch.setattr(bench_train, "datasheet_peak_flops", lambda dtype, device: 2e11)
    code = bench_train.main(["--device", "cpu", "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "64",
                             "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "batch 2x16, fp32" in out and "fp32 datasheet dense peak: 0.2 TFLOP/s" in out
    assert "of datasheet, " in out and "of measured GEMM peak" in out and "peak memory" not in out


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_train.main(["--device", "cuda"]) == 2
    assert "torch sees no GPU" in capsys.readouterr().out
