"""``xscale bench memory``: layouts checked before anything runs, and a tiny run that prints predicted / measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xscale.cli import main

TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.seq_len=32",
        "train.global_batch_size=4", "data.dataset.options={num_symbols: 8}"]


@pytest.mark.parametrize("layout, named", [("tp=2,banana=3", "'banana=3' is not name=value"),
                                           ("dp_shard", "'dp_shard' is not name=value")])
def test_unknown_layout_is_one_clear_line(capsys, layout, named):
    assert main(["bench", "memory", *TINY, "--layouts", "single", layout]) == 2
    err = capsys.readouterr().err
    assert named in err and "zero_stage" in err and "Traceback" not in err


def test_bad_step_count_is_refused(capsys):
    assert main(["bench", "memory", *TINY, "--steps", "0"]) == 2
    assert "--steps 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.slow  # one process, then two with ZeRO-3, a save and a resume: ~25 s on 2 loaded cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bench_prints_predicted_and_measured_per_rank():
    result = subprocess.run([sys.executable, "-m", "xscale", "bench", "memory", *TINY, "--steps", "1", "--checkpoint",
                             "--layouts", "single", "dp_shard=2,zero_stage=3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("single", "dp_shard=2"))]
    assert [row[:2] for row in rows] == [["single", "0"], ["dp_shard=2,zero_stage=3", "0"],
                                          ["dp_shard=2,zero_stage=3", "1"]]
    for row in rows:  # predicted, measured and their ratio: a tiny model's peak is mostly the process's own
        predicted, measured, ratio = (float(value.replace(",", "")) for value in row[2:5])
        # Both MiB figures are printed to 0.1 and the ratio to 0.001: the ratio of the printed figures may differ
        # from the printed ratio by what those roundings allow (1.4 / 17.5 printed as 0.082 is right for 1.44).
        rounding = 0.05 / measured + 0.05 * predicted / measured**2 + 5e-4
        assert predicted > 0 and measured > 0 and ratio == pytest.approx(predicted / measured, abs=rounding + 1e-6)
        state_ratio = float(row[7])  # the model state alone is exact: the formulas against the live tensors
        assert state_ratio == pytest.approx(1.0, abs=0.03)
