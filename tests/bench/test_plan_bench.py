"""``xscale bench plan``: its layouts are what the planner predicts and the validator accepts, bad options are one
line, and a quick run prints the table and the summary."""

from __future__ import annotations

import sys

import pytest

from xscale.bench.plan import LAYOUTS, MODEL, BenchLayout, summary
from xscale.cli import main
from xscale.config.load import load_config
from xscale.estimate.layout import Layout
from xscale.estimate.search import Plan
from xscale.estimate.step_time import StepTime
from xscale.parallel.checks import resolve_layout


def test_layouts_cover_the_dimensions_and_pass_the_validator():
    layouts = [bench.layout for bench in LAYOUTS]
    assert len(layouts) >= 12 and {layout.world_size for layout in layouts} == {1, 2, 4}
    assert {layout.zero_stage for layout in layouts} == {0, 1, 2, 3}
    assert {layout.schedule for layout in layouts if layout.pp > 1} >= {"1f1b", "gpipe", "interleaved_1f1b"}
    assert any(layout.tp > 1 for layout in layouts) and any(layout.checkpointing == "full" for layout in layouts)
    assert any(bench.moe and bench.layout.ep > 1 and bench.layout.dp > bench.layout.ep for bench in LAYOUTS)
    assert all(bench.moe for bench in LAYOUTS if bench.layout.ep > 1)  # expert parallelism needs the MoE variant
    for bench in LAYOUTS:
        config = load_config(overrides=[*MODEL, *bench.overrides()])
        assert (config.model.moe.num_experts > 0) == bench.moe
        dims, _ = resolve_layout(config, bench.world_size)
        layout = bench.layout
        assert (dims.tp, dims.pp, dims.dp_shard, dims.ep, dims.zero_stage) == (layout.tp, layout.pp, layout.dp,
                                                                              layout.ep, layout.zero_stage)


def _row(bench: BenchLayout, predicted: float, measured: float, memory: float) -> dict:
    plan = Plan(bench.layout, StepTime(predicted, 0.0, 0.0), 100.0, 1 / predicted, 0.5)
    return {"layout": bench, "plan": plan, "predicted_s": predicted, "measured_s": measured,
            "predicted_tokens_per_s": 1 / predicted, "measured_tokens_per_s": 1 / measured,
            "predicted_peak": 100.0 * memory, "measured_peak": 100.0}


def test_summary_figures():
    rows = [_row(BenchLayout(Layout(dp=2)), 1.0, 1.1, 0.95), _row(BenchLayout(Layout(tp=2)), 2.0, 1.0, 1.0),
            _row(BenchLayout(Layout()), 3.0, 3.3, 1.2)]
    figures = summary(rows)
    assert figures["spearman"] == pytest.approx(0.5)  # predicted order 1, 2, 3 against measured 2, 1, 3
    assert figures["median_step_error"] == pytest.approx(1 / 11)  # |1/1.1 - 1|, |2 - 1|, |3/3.3 - 1|
    assert (figures["memory_low"], figures["memory_high"]) == (0.95, 1.2)
    assert figures["first_choice"] == "dp=2 zero0 mb=1x1" and figures["first_vs_best"] == pytest.approx(1 / 1.1)
    # a MoE layout is another model: neither the planner's first choice nor the best measured of the dense model
    moe = _row(BenchLayout(Layout(dp=2, ep=2), moe=True), 0.5, 0.2, 1.0)
    assert summary([*rows, moe])["first_vs_best"] == pytest.approx(1 / 1.1)


def test_bad_options_are_one_line(capsys):
    assert main(["bench", "plan", "--steps", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("xscale bench plan: need --steps >= 1") and "\n" not in error
    assert main(["bench", "plan", "--only", "no such layout"]) == 2  # a filter that leaves nothing is refused
    error = capsys.readouterr().err.strip()
    assert "--only that matches a layout" in error and "no such layout" in error and "\n" not in error


@pytest.mark.slow  # a quick calibration over 2 processes and the 3 one-process layouts: ~1 min on 2 loaded cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_quick_run_prints_the_summary(capsys):
    assert main(["bench", "plan", "--quick", "--max-processes", "1", "--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 layouts: Spearman (tokens/s)" in out and "single device mb=16x1" in out
