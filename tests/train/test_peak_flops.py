"""The MFU denominator: the best of several GEMM shapes, measured once per (torch, device, dtype, threads) and
cached. No test depends on real timings: a fake timer stands in for the matmuls."""

from __future__ import annotations

import csv
import json
import time

import pytest
import torch

from xscale.config.load import load_config
from xscale.train import peak_flops as peak
from xscale.train.peak_flops import MfuDenominator, best_gemm_flops, cache_key, peak_flops
from xscale.train.trainer import Trainer

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
    assert {key: entry["flops"] for key, entry in cached.items()} == {cache_key(torch.float32, "cpu"): 1e11,
                                                                     cache_key(torch.bfloat16, "cpu"): 3e11}


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
    assert json.loads(path.read_text())[cache_key(torch.float32, "cpu")]["flops"] == 5e10
    blocked = tmp_path / "a_file" / "peak_flops.json"
    (tmp_path / "a_file").write_text("")  # its parent is a file: nothing can be written there
    assert peak_flops(torch.float32, "cpu", blocked, lambda dtype, device: 7e10) == 7e10


def _poison(path, flops, threads=None, measured_at=None, dtype=torch.float32):
    """Write ``flops`` into the cache as this machine's entry (``threads``: as another thread count's entry)."""
    cached = json.loads(path.read_text()) if path.exists() else {}
    key = cache_key(dtype, "cpu")
    if threads is not None:
        key = key.replace(f"x{torch.get_num_threads()} threads", f"x{threads} threads")
    cached[key] = {"flops": flops, "measured_at": time.time() if measured_at is None else measured_at,
                   "apart": peak._threads_apart("cpu"), "dtype": "float32",
                   "threads": torch.get_num_threads() if threads is None else threads}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached))


def test_an_old_entry_or_one_of_an_earlier_release_is_measured_again(tmp_path):
    path = tmp_path / "peak_flops.json"
    _poison(path, 1e9, measured_at=time.time() - (peak.MAX_AGE_DAYS + 1) * 86400)
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 4e10) == 4e10
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 9e10) == 4e10  # now fresh: read back
    path.write_text(json.dumps({cache_key(torch.float32, "cpu"): 1e9}))  # a bare number has no date
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 4e10) == 4e10


@pytest.mark.parametrize("other", [(1e11, "fewer threads far faster"), (1e7, "far beyond linear scaling")])
def test_an_entry_out_of_line_with_another_thread_count_is_measured_again(tmp_path, other):
    """The issue's case: 30 GFLOP/s cached for 2 threads beside 148 for 1 thread, measured while the cores were
    busy, and kept for ever."""
    path = tmp_path / "peak_flops.json"
    threads = torch.get_num_threads()
    _poison(path, 3e9)
    _poison(path, other[0] * (threads + 1) / threads, threads=threads + 1)  # out of line either way
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 5e9) == 5e9, other[1]
    _poison(path, 3e9)
    _poison(path, 3e9 * 1.1, threads=threads + 1)  # in line: read back
    assert peak_flops(torch.float32, "cpu", path, lambda dtype, device: 5e9) == 3e9


def test_a_step_faster_than_the_peak_measures_it_again_and_mfu_stays_at_most_one():
    lines, asked = [], []

    def measure(dtype, device, fresh=False):
        asked.append(fresh)
        return 1e9 if not fresh else 4e9  # the cached value was taken on a busy machine

    denominator = MfuDenominator(torch.float32, "cpu", measure=measure, announce=lines.append)
    assert denominator.mfu(5e8) == pytest.approx(0.5) and not lines
    assert denominator.mfu(2e9) == pytest.approx(0.5)  # measured again: 4e9
    assert asked == [False, True] and "above the matmul peak of 1.0 GFLOP/s" in lines[0]
    assert denominator.mfu(8e9) == pytest.approx(1.0)  # measured once per run; the step's rate bounds the peak
    assert asked == [False, True]


def test_a_pinned_peak_is_kept_and_a_step_beating_it_is_said_once():
    lines = []
    denominator = MfuDenominator(torch.float32, "cpu", pinned=1e9, measure=pytest.fail, announce=lines.append)
    assert denominator.mfu(2e9) == pytest.approx(2.0) and denominator.mfu(3e9) == pytest.approx(3.0)
    assert len(lines) == 1 and "train.peak_flops=1e+09" in lines[0]


def test_a_poisoned_cache_cannot_make_a_run_report_mfu_above_100_percent(tmp_path, monkeypatch, one_thread):
    """A run with 1 MFLOP/s in the cache (``XSCALE_CACHE_DIR``) and a re-measurement that still reads low (the
    machine stays busy): every logged MFU is at most 1."""
    monkeypatch.setenv("XSCALE_CACHE_DIR", str(tmp_path / "cache"))
    _poison(tmp_path / "cache" / "peak_flops.json", 1e6)
    monkeypatch.setattr(peak, "best_gemm_flops", lambda dtype, device: 2e6)
    config = load_config(None, ["model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4",
                                "train.global_batch_size=4", "train.seq_len=16", "train.steps=3", "train.log_every=1",
                                "train.plot=false", "train.progress=false", "train.loggers=[csv]",
                                "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0",
                                f"train.output_dir={tmp_path / 'run'}"])
    Trainer(config).fit()
    with (tmp_path / "run" / "metrics.csv").open(newline="") as handle:
        mfu = [float(row["perf/mfu"]) for row in csv.DictReader(handle) if row.get("perf/mfu")]
    assert len(mfu) == 3 and max(mfu) <= 1.0
