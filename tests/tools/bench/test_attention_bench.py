"""``xscale bench attention`` at tiny sizes: the table's structure, finite ratios, memory marks; no timing asserted."""

import csv
import math

import torch

from xscale.tools.bench import attention as bench

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
