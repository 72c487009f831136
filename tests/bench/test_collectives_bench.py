"""Smoke test of ``xscale bench collectives``: every collective is timed and both ratios are finite and positive
(no timings are asserted)."""

from __future__ import annotations

import math
import re

from xscale.commands.bench import main as bench_main


def test_tiny_run_reports_both_ratios(capsys):
    assert bench_main(["collectives", "--megabytes", "0.1", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    ratios = dict(re.findall(r"(all_gather|reduce_scatter): torch / xscale time ([0-9.]+)x", out))
    assert set(ratios) == {"all_gather", "reduce_scatter"}, out
    assert all(math.isfinite(float(r)) and float(r) > 0 for r in ratios.values()), out
    assert len(re.findall(r" ms$", out, flags=re.M)) == 5, out
