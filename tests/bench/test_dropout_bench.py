"""Smoke test of ``xscale bench dropout``: both comparisons run and report finite, positive ratios (no timings
are asserted)."""

from __future__ import annotations

import math
import re

from xscale.commands.bench import main as bench_main


def test_tiny_run_reports_both_ratios(capsys):
    assert bench_main(["dropout", "--shape", "2", "16", "64", "--repeats", "2", "--block-repeats", "1"]) == 0
    out = capsys.readouterr().out
    alone = [float(r) for r in re.findall(r"dropout alone.*ratio ([0-9.]+)", out)]
    block = [float(r) for r in re.findall(r"Transformer block.*ratio ([0-9.]+)", out)]
    assert len(alone) == 2 and len(block) == 2, out
    assert all(math.isfinite(r) and r > 0 for r in alone + block), out
