"""``xscale bench kernels`` at tiny sizes: a row per op, checks passing, a CSV; and its memory measure itself.

No timing is asserted (machines are noisy); memory figures are allocation counts, which are deterministic.
"""

import csv

import pytest
import torch

from xscale.bench import kernels as bench
from xscale.ops import reference
from xscale.ops.chunked_cross_entropy import chunked_linear_cross_entropy_sum

TINY = ["--tokens", "48", "--hidden", "32", "--heads", "2", "--vocab", "300", "--seq", "16", "--attention-seq", "32",
        "--block", "16", "--experts", "4", "--repeats", "1", "--device", "cpu"]
OPS = ["rms_norm", "rms_norm_residual", "layer_norm_residual", "swiglu", "geglu", "rope", "linear_cross_entropy",
       "moe_permute", "block_sparse_attention"]


def _run(tmp_path, capsys, backend):
    path = tmp_path / f"{backend}.csv"
    assert bench.main([*TINY, "--backend", backend, "--csv", str(path)]) == 0
    printed = capsys.readouterr().out
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    return printed, rows


@pytest.mark.parametrize(("backend", "paths"), [
    ("auto", {"linear_cross_entropy": "torch chunked", "block_sparse_attention": "torch gathered"}),
    ("triton", dict.fromkeys(OPS, "triton (interpreter)")),
], ids=["auto-cpu", "triton-interpreter"])
def test_prints_a_checked_row_per_op_and_writes_the_csv(tmp_path, capsys, backend, paths):
    printed, rows = _run(tmp_path, capsys, backend)
    table_ops = [line.split()[0] for line in printed.splitlines() if line.split() and line.split()[0] in OPS]
    assert table_ops == OPS, printed
    assert [row["op"] for row in rows] == OPS
    for row in rows:
        assert row["check"] == "ok", row
        assert row["path"] == paths.get(row["op"], "torch (= reference)"), row
        assert float(row["reference_peak_mib"]) > 0 and float(row["fused_peak_mib"]) > 0, row
    assert "cross-entropy memory (48x32 vocab 300): peak" in printed


def test_compile_column_times_the_compiled_reference(tmp_path, capsys):
    """The one real inductor build of the tests (one small op: ~10 s on 2 cores); off by default on CPU."""
    path = tmp_path / "compiled.csv"
    assert bench.main([*TINY, "--ops", "rms_norm", "--compile", "--csv", str(path)]) == 0
    assert "vs compiled" in capsys.readouterr().out
    with open(path) as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["compile"] == "ok", row
    assert float(row["compiled_ms"]) > 0 and float(row["vs_compiled"]) > 0 and float(row["compiled_peak_mib"]) >= 0


def test_no_compile_leaves_the_column_empty(tmp_path, capsys):
    path = tmp_path / "plain.csv"
    assert bench.main([*TINY, "--ops", "rms_norm,swiglu", "--no-compile", "--csv", str(path)]) == 0
    assert "no torch.compile column" in capsys.readouterr().out
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["compile"], row["compiled_ms"]) for row in rows] == [("off", ""), ("off", "")]


def test_a_compile_failure_is_reported_in_its_op_row(monkeypatch, tmp_path, capsys):
    """Each op's compile failure is printed in the compiled column; the eager and fused columns still run."""
    def failing_compile(fn, **kwargs):
        assert kwargs == {"dynamic": False}

        def compiled(*args):
            raise RuntimeError("inductor says no\nlong traceback")
        return compiled

    monkeypatch.setattr(bench.torch, "compile", failing_compile)
    path = tmp_path / "failed.csv"
    assert bench.main([*TINY, "--ops", "rms_norm,swiglu", "--compile", "--csv", str(path)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("rms_norm", "swiglu"))]
    assert len(table) == 2 and all(line.endswith("compile failed: RuntimeError: inductor says no") for line in table)
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert all(row["check"] == "ok" and float(row["fused_ms"]) > 0 and row["compiled_ms"] == "" for row in rows)


def test_an_op_that_raises_is_reported_and_the_others_still_run(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed to build")

    monkeypatch.setattr(bench.ops, "gated_activation", broken)
    assert bench.main([*TINY, "--ops", "rms_norm,swiglu"]) == 1
    captured = capsys.readouterr()
    assert "swiglu: RuntimeError: kernel failed to build" in captured.err
    assert "\nrms_norm " in captured.out and "not measured (see above): swiglu" in captured.out
    assert bench.main([*TINY, "--ops", "swiglu"]) == 2


def test_unknown_op_and_bad_head_split_are_refused(capsys):
    assert bench.main([*TINY, "--ops", "rms_norm,flash"]) == 2
    assert "unknown ops ['flash']" in capsys.readouterr().err
    assert bench.main([*TINY, "--heads", "3"]) == 2
    assert "even head dim" in capsys.readouterr().err


def test_a_wrong_fused_result_fails_the_check(monkeypatch, capsys):
    """The bench's own check must catch a fused path that differs from the reference."""
    monkeypatch.setattr(bench.ops, "rms_norm", lambda x, w, eps, backend: reference.rms_norm(x, w, eps) * 1.001)
    assert bench.main([*TINY, "--ops", "rms_norm"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_peak_cpu_allocation_is_the_high_water_mark_of_the_run():
    mib = 2**20

    def allocate():
        first = torch.empty(mib, dtype=torch.uint8)
        del first  # freed before the larger one exists: the peak is 3 MiB, not 4
        return torch.ones(3 * mib, dtype=torch.uint8)

    assert bench.peak_cpu_allocation(allocate) == 3 * mib


def test_chunked_cross_entropy_holds_a_chunk_not_the_logits():
    """Forward + backward peak of the chunked loss vs CE(h W^T): the (tokens, vocab) logits never exist whole."""
    hidden = torch.randn(512, 32, requires_grad=True)
    weight = torch.randn(8000, 32, requires_grad=True)
    labels = torch.randint(0, 8000, (512,))

    def step(loss_fn):
        hidden.grad = weight.grad = None
        return bench.peak_cpu_allocation(lambda: loss_fn(hidden, weight, labels).backward())

    unfused = step(reference.linear_cross_entropy_sum)
    chunked = step(lambda h, w, y: chunked_linear_cross_entropy_sum(h, w, y, chunk_tokens=64))
    logits_bytes = 512 * 8000 * 4
    assert unfused >= 2 * logits_bytes  # logits and their log-softmax at least
    # one (64, vocab) chunk buffer, float32 dW and dh, small per-token vectors
    assert chunked <= 64 * 8000 * 4 + weight.numel() * 4 + hidden.numel() * 4 + 64 * 1024


def test_the_cross_entropy_chunk_is_a_flag_and_a_smaller_chunk_holds_less(tmp_path, capsys):
    """--ce-chunk-tokens: the row names the chunk, the check still passes, and the fused side's peak follows it."""
    peaks = {}
    for chunk in (8, 48):
        path = tmp_path / f"ce{chunk}.csv"
        assert bench.main([*TINY, "--ops", "linear_cross_entropy", "--ce-chunk-tokens", str(chunk),
                           "--csv", str(path)]) == 0
        with open(path) as handle:
            (row,) = list(csv.DictReader(handle))
        assert row["check"] == "ok" and f"chunks of {chunk}" in row["shape"], row
        peaks[chunk] = float(row["fused_peak_mib"])
    assert "chunks of 48" in capsys.readouterr().out
    assert peaks[8] < peaks[48], peaks
