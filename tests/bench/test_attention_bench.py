"""``xscale bench attention`` at tiny sizes: the table's structure, finite ratios, memory marks; no timing asserted."""

import csv
import math

import pytest
import torch

from xscale.bench import attention as bench
from xscale.bench import attention_gpu

TINY = ["--lengths", "64", "--long-lengths", "128", "--variants", "local,linear", "--repeats", "1",
        "--d-model", "32", "--heads", "2"]


def test_tiny_run_writes_table_csv_and_plot(tmp_path, capsys) -> None:
    assert bench.main([*TINY, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "attention.csv") as handle:
        rows = list(csv.DictReader(handle))
    cases = {(r["variant"], int(r["length"])) for r in rows}
    # the long length runs the linear-memory variants and SDPA, not the quadratic naive baseline
    assert cases == {("naive", 64), ("sdpa", 64), ("local", 64), ("linear", 64), ("sdpa", 128), ("local", 128),
                     ("linear", 128)}
    for r in rows:
        for key in ("seconds", "peak_mib", "saved_mib", "vs_sdpa"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (r, key)
        assert (r["vs_naive"] != "") == (int(r["length"]) == 64), r
    table = (tmp_path / "attention.md").read_text()
    assert "| variant | causal | 64 | 128 | peak 16K/8K | crossover vs naive | crossover vs SDPA |" in table
    for name in ("naive", "sdpa", "local", "linear"):
        assert f"\n| {name} | yes |" in table
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert "local at T=4096 vs naive: - (target >= 10x): not measured" in capsys.readouterr().out


def test_memory_sees_the_naive_score_matrix() -> None:
    """The allocator peak includes the transient T x T matrices; saved bytes include the kept probabilities."""
    heads, length = 2, 256
    q, k, v, grad = (torch.randn(1, heads, length, 16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = bench.make_runner("naive", length, True, heads, 32)
    peak, saved = bench.measure_memory(fn, q, k, v, grad)
    matrix = heads * length * length * 4
    assert saved >= matrix
    assert peak is not None and peak >= 2 * matrix  # scores and probabilities live together in the forward
    sdpa_peak, _ = bench.measure_memory(bench.make_runner("sdpa", length, True, heads, 32), q, k, v, grad)
    assert sdpa_peak < matrix


def test_case_that_would_not_fit_is_marked_not_run(monkeypatch) -> None:
    monkeypatch.setattr(bench, "available_bytes", lambda: 2**10)  # 1 KiB: only the first length runs
    rows = bench.run([64, 128], [], ["local"], 1, 32, 2, 60.0, log=lambda line: None)
    second = [r for r in rows if r["length"] == 128]
    assert all(r["seconds"] is None and r["note"].startswith("not run (out of memory)") for r in second)
    assert "not run" in bench.summary_table(rows, ["naive", "sdpa", "local"])


def test_a_first_length_too_long_for_naive_attention_is_not_run(monkeypatch) -> None:
    """The issue's case: `--lengths 16384` alone ran the naive baseline (no smaller length measured) into the OOM
    killer. Its memory comes from the shape: 3 score matrices of 2 x 256^2 fp32 (1.5 MiB) over half of 2 MiB."""
    monkeypatch.setattr(bench, "available_bytes", lambda: 2 * 2**20)
    rows = bench.run([256], [], ["local"], 1, 32, 2, 60.0, log=lambda line: None)
    naive = [r for r in rows if r["variant"] == "naive"]
    assert naive and all(r["seconds"] is None and "score matrices" in r["note"] for r in naive)
    assert all(r["seconds"] is not None for r in rows if r["variant"] == "sdpa")  # SDPA holds no score matrix
    assert bench.naive_peak_bytes(8, 16384) == 24 * 2**30  # the 23.7 GiB the issue measured


def test_crossover_is_the_length_from_which_the_variant_stays_faster() -> None:
    def row(variant, length, seconds):
        return {"variant": variant, "causal": True, "length": length, "seconds": seconds}

    rows = [row("sdpa", n, n / 1000) for n in (1024, 2048, 4096, 8192)]
    rows += [row("a", 1024, 2.0), row("a", 2048, 3.0), row("a", 4096, 1.0), row("a", 8192, 1.0)]
    rows += [row("b", 1024, 0.1), row("b", 2048, 9.0), row("b", 4096, 0.1), row("b", 8192, 9.0)]
    assert bench.crossover(rows, "a", True, "sdpa") == "4096"
    assert bench.crossover(rows, "b", True, "sdpa") == "> 8192 (faster only at 1024, 4096)"
    assert bench.crossover(rows, "a", True, "naive") == "n/a"


def test_lean_memory_target_compares_with_sdpa_at_the_same_length() -> None:
    def row(variant, length, peak):
        return {"variant": variant, "causal": True, "length": length, "peak_mib": peak, "seconds": None,
                "vs_naive": None, "vs_sdpa": None}

    rows = [row("sdpa", 16384, 160.0), row("local", 16384, 150.0), row("linear", 16384, 170.0),
            row("sdpa", 8192, 80.0), row("local", 8192, 90.0)]
    lines = bench.target_lines(rows, ["sdpa", "local", "linear"])
    assert "- local peak at T=16384: 150 MiB vs SDPA's 160 MiB (target <= SDPA's): met" in lines
    assert "- linear peak at T=16384: 170 MiB vs SDPA's 160 MiB (target <= SDPA's): MISSED" in lines
    assert not any("T=8192" in line for line in lines)


# The GPU mode's code path, run on CPU: SDPA without forcing flash, the local rows through the backend passed
# (the Triton kernel in triton's interpreter: tests/bench/conftest.py sets TRITON_INTERPRET=1).

def test_sliding_window_layout_lists_the_block_and_those_before_it_within_the_window() -> None:
    layout = attention_gpu.sliding_window_layout(4096, 128, 1024, torch.device("cpu"))
    counts = layout.count[0].tolist()
    assert counts[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 8] and set(counts[8:]) == {8}
    assert sorted(layout.index[0, 10].tolist()) == list(range(3, 11))


@pytest.mark.parametrize("sparse_backend", ["torch", "triton"])
def test_gpu_mode_rows_run_on_cpu(sparse_backend) -> None:
    lines = []
    rows = attention_gpu.run_gpu([64, 128], torch.device("cpu"), torch.float32, 1, 16, 16, 32, 1, 60.0,
                                 sparse_backend, log=lines.append)
    local = f"local_{sparse_backend}"
    zoo = ("zoo_local", "zoo_bigbird", "zoo_longformer")
    assert [(r["row"], r["length"]) for r in rows] == [(name, n) for n in (64, 128)
                                                       for name in ("sdpa_flash", local, "local_flex", *zoo)]
    for r in rows:
        if r["row"] == "local_flex" and r["ms"] is None:  # the flex backend trains on CUDA only
            assert r["note"].startswith(("flex: unavailable", "not run")), r
            continue
        assert r["ms"] > 0 and r["vs_flash"] > 0 and r["peak_mib"] is None, r
        assert not r["note"], r
    checked = [r for r in rows if r["max_error"] is not None]
    assert {r["length"] for r in checked} == {64} and all(r["max_error"] < 1e-5 for r in checked)
    assert {r["row"] for r in checked} >= {local, *zoo}  # each zoo core against SDPA over its token mask
    assert len(lines) == 14 and lines[0].startswith("T=    64 sdpa_flash") and lines[6].startswith("T=    64 done in")


def test_gpu_mode_stops_a_row_that_exceeds_max_seconds() -> None:
    rows = attention_gpu.run_gpu([64, 128], torch.device("cpu"), torch.float32, 1, 16, 16, 32, 1, 0.0, "torch",
                                 log=lambda line: None)
    flash = [r for r in rows if r["row"] == "sdpa_flash"]
    assert flash[0]["ms"] is None and "> --max-seconds: not timed" in flash[0]["note"]
    assert flash[1]["note"].startswith("not run: T=64 took")


def test_gpu_mode_main_writes_its_csv_and_the_32k_target(tmp_path, capsys) -> None:
    assert attention_gpu.main_gpu([64], torch.device("cpu"), 1, 16, 16, 32, 1, 60.0, tmp_path) == 0
    with open(tmp_path / "attention_gpu.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["row"] for r in rows] == ["sdpa_flash", "local_triton", "local_flex", "zoo_local", "zoo_bigbird",
                                        "zoo_longformer"]
    assert "bf16, batch 1, 1 heads x 16" in capsys.readouterr().out
    row = {"row": "local_triton", "length": 32768, "ms": 2.0, "peak_mib": 10.0, "vs_flash": 3.5, "max_error": None,
           "warmup_s": 1.5, "note": ""}
    assert attention_gpu.format_row(row).endswith("warm-up 1.5 s  target >= 3x flash: met")
    assert attention_gpu.format_row({**row, "row": "sdpa_flash"}).endswith("3.50x flash  warm-up 1.5 s")
    # the zoo's cores through FlexAttention answer to issue 47's 5x
    assert attention_gpu.format_row({**row, "row": "zoo_bigbird_flex"}).endswith("target >= 5x flash: MISSED")
    assert attention_gpu.format_row({**row, "row": "zoo_longformer_flex", "vs_flash": 5.2}).endswith(
        "target >= 5x flash: met")


def test_device_cuda_without_a_gpu_is_refused(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert bench.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
