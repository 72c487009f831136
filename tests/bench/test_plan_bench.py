"""``xscale bench plan``: its layouts are what the planner predicts and the validator accepts, bad options are one
line, and a quick run prints the table and the summary."""

from __future__ import annotations

import sys

import pytest

from xscale.bench.plan import LAYOUTS, MODEL, layout_overrides, summary
from xscale.cli import main
from xscale.config.load import load_config
from xscale.estimate.layout import Layout
from xscale.estimate.search import Plan
from xscale.estimate.step_time import StepTime
from xscale.parallel.checks import resolve_layout


def test_layouts_cover_the_dimensions_and_pass_the_validator():
    assert len(LAYOUTS) >= 12 and {layout.world_size for layout in LAYOUTS} == {1, 2, 4}
    assert {layout.zero_stage for layout in LAYOUTS} == {0, 1, 2, 3}
    assert {layout.schedule for layout in LAYOUTS if layout.pp > 1} >= {"1f1b", "gpipe", "interleaved_1f1b"}
    assert any(layout.tp > 1 for layout in LAYOUTS) and any(layout.checkpointing == "full" for layout in LAYOUTS)
    for layout in LAYOUTS:
        config = load_config(overrides=[*MODEL, *layout_overrides(layout)])
        dims, _ = resolve_layout(config, layout.world_size)
        assert (dims.tp, dims.pp, dims.dp_shard, dims.zero_stage) == (layout.tp, layout.pp, layout.dp,
                                                                     layout.zero_stage)


def _row(layout: Layout, predicted: float, measured: float, memory: float) -> dict:
    plan = Plan(layout, StepTime(predicted, 0.0, 0.0), 100.0, 1 / predicted, 0.5)
    return {"layout": layout, "plan": plan, "predicted_s": predicted, "measured_s": measured,
            "predicted_tokens_per_s": 1 / predicted, "measured_tokens_per_s": 1 / measured,
            "predicted_peak": 100.0 * memory, "measured_peak": 100.0}


def test_summary_figures():
    rows = [_row(Layout(dp=2), 1.0, 1.1, 0.95), _row(Layout(tp=2), 2.0, 1.0, 1.0), _row(Layout(), 3.0, 3.3, 1.2)]
    figures = summary(rows)
    assert figures["spearman"] == pytest.approx(0.5)  # predicted order 1, 2, 3 against measured 2, 1, 3
    assert figures["median_step_error"] == pytest.approx(1 / 11)  # |1/1.1 - 1|, |2 - 1|, |3/3.3 - 1|
    assert (figures["memory_low"], figures["memory_high"]) == (0.95, 1.2)
    assert figures["first_choice"] == "dp=2 zero0 mb=1x1" and figures["first_vs_best"] == pytest.approx(1 / 1.1)


def test_bad_options_are_one_line(capsys):
    assert main(["bench", "plan", "--steps", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("xscale bench plan: need --steps >= 1") and "\n" not in error


@pytest.mark.slow  # a quick calibration over 2 processes and the 3 one-process layouts: ~1 min on 2 loaded cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_quick_run_prints_the_summary(capsys):
    assert main(["bench", "plan", "--quick", "--max-processes", "1", "--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 layouts: Spearman (tokens/s)" in out and "single device mb=16x1" in out
