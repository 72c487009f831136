"""``xscale bench train``: the profiler breakdown's GEMM share, and one tiny run at bf16 with --profile."""

from __future__ import annotations

import pytest
import torch

from xscale.tools.bench import train as bench_train
from xscale.tools.bench.train import profile_breakdown


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
