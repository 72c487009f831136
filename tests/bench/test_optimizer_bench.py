"""Smoke test of ``xscale bench optimizer``: every update mode is timed and reported with its ratio to the fused
update and its difference from the per-parameter one (no timings are asserted)."""

from __future__ import annotations

import math
import re

from xscale.commands.bench import main as bench_main


def test_tiny_run_reports_every_mode(capsys):
    assert bench_main(["optimizer", "model.n_layers=1", "model.d_model=32", "model.vocab_size=64",
                       "model.n_heads=2", "model.n_kv_heads=2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\w+)\s+([0-9.]+) ms\s+([0-9.]+)x fused's time\s+max difference from per_parameter "
                      r"([0-9.e+-]+)$", out, flags=re.M)
    assert [row[0] for row in rows] == ["fused", "per_parameter", "foreach"], out
    assert all(math.isfinite(float(row[1])) and float(row[1]) > 0 for row in rows), out
    differences = {row[0]: float(row[3]) for row in rows}
    assert differences["per_parameter"] == 0.0 and differences["fused"] < 1e-6, out
