"""``xscale bench moe`` at tiny sizes: every workload timed, the target ratios finite and positive.

No timing is asserted (machines are noisy).
"""

import argparse
import math

import pytest

from xscale.bench import moe as bench

TINY = ["--tokens", "64", "--d-model", "16", "--hidden", "32", "--experts", "4", "--rounds", "1"]


def tiny_args(ep: int, top_k: int = 1, dtype: str = "fp32") -> argparse.Namespace:
    return argparse.Namespace(tokens=64, d_model=16, hidden=32, experts=4, top_k=top_k, capacity_factor=1.25, rounds=1,
                              ep=ep, device="cpu", dtype=dtype)


def assert_positive_and_finite(values: dict) -> None:
    for name, value in values.items():
        assert math.isfinite(value) and value > 0, (name, value)


@pytest.mark.parametrize("top_k", [1, 2])
def test_one_process_times_ours_deepspeed_and_dense(top_k, capsys):
    pytest.importorskip("deepspeed.moe.layer", reason="deepspeed is not installed")
    figures = bench.run(tiny_args(ep=1, top_k=top_k))
    assert set(figures["single"]) == {"xscale_moe", "dense_ffn", "xscale_experts_only", "deepspeed_moe",
                                      "dropped_fraction"}
    assert set(figures["ratios"]) == {"moe_over_dense_step_time", "xscale_over_deepspeed_tokens_per_s",
                                      "experts_only_over_dense_step_time", "deepspeed_over_dense_step_time"}
    assert_positive_and_finite(figures["ratios"])
    assert 0.0 <= figures["single"]["dropped_fraction"] < 1.0
    assert bench.main([*TINY, "--ep", "1", "--top-k", str(top_k)]) == 0
    printed = capsys.readouterr().out
    assert f"experts, top-{top_k}, capacity factor 1.25" in printed
    assert "xscale/DeepSpeed tokens/s, 1 process (target >= ceiling / 1.15):" in printed
    assert "MoE/dense FFN step time (target <= 1.15x):" in printed
    assert "ceiling of that ratio for an MoE no faster than the dense FFN (DeepSpeed/dense step time):" in printed


@pytest.mark.slow  # two processes bringing up DeepSpeed's groups: ~25 s on 2 loaded cores
def test_expert_parallel_times_ours_and_deepspeed_over_two_processes():
    pytest.importorskip("deepspeed.moe.layer", reason="deepspeed is not installed")
    figures = bench.run(tiny_args(ep=2))
    assert set(figures["ep2"]) == {"xscale_moe", "deepspeed_moe"}
    assert_positive_and_finite(figures["ep2"])
    assert {"ep2_over_single_tokens_per_s", "ep2_xscale_over_deepspeed_tokens_per_s"} <= set(figures["ratios"])
    assert_positive_and_finite(figures["ratios"])


def test_experts_that_do_not_split_over_ep_are_refused(capsys):
    assert bench.main([*TINY, "--experts", "3", "--ep", "2"]) == 2
    assert "must split over --ep 2" in capsys.readouterr().err


def test_without_deepspeed_it_times_ours_and_dense_in_bf16(capsys, monkeypatch):
    monkeypatch.setattr(bench, "deepspeed_available", lambda: False)
    assert bench.main([*TINY, "--ep", "1", "--device", "cpu", "--dtype", "bf16"]) == 0
    printed = capsys.readouterr().out
    assert "top-1, capacity factor 1.25" in printed and ", bf16, " in printed and "deepspeed_moe" not in printed
    assert "DeepSpeed skipped, xscale vs dense only" in printed and "MoE/dense FFN step time" in printed


def test_expert_parallel_on_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    assert bench.main([*TINY, "--ep", "2", "--device", "cuda"]) == 2
    assert "--ep 2 runs on the CPU only" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main([*TINY, "--ep", "1", "--device", "cuda"]) == 2
    assert "torch sees no GPU" in capsys.readouterr().err
