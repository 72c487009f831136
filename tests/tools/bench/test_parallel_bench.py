"""``xscale bench parallel``: the bubble arithmetic, the compute clock, and a tiny run of one pipeline layout.

No timing is asserted (machines are noisy): ratios must be finite and positive, bubbles inside (0, 1).
"""

import math
import time

import pytest

from xscale.parallel.pipeline import ideal_bubble
from xscale.tools.bench import parallel as bench

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "train.global_batch_size=4",
        "train.seq_len=16", "data.num_samples=64"]


def test_theoretical_and_measured_bubble_formulas():
    assert ideal_bubble(2, 4) == pytest.approx(1 / 5)
    assert ideal_bubble(4, 8) == pytest.approx(3 / 11)
    assert bench.bubble_fraction(compute_seconds=0.75, step_seconds=1.0) == pytest.approx(0.25)


def test_compute_clock_adds_the_time_inside_wrapped_calls_only():
    clock = bench.ComputeClock()
    nap = clock.wrap(lambda seconds: time.sleep(seconds) or "done")
    time.sleep(0.05)  # outside: not counted
    assert nap(0.02) == "done" and nap(0.03) == "done"
    assert 0.05 <= clock.seconds < 0.1

    @clock.wrap
    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fails()


@pytest.mark.slow  # two sets of fresh processes: ~80 s on 2 loaded cores
def test_a_pipeline_layout_reports_its_bubble_and_throughput_ratio(capsys):
    layout = "pp=2,dp_shard=1,microbatches=2,pp_schedule=1f1b"
    rows = bench.measure_layouts(None, TINY, [layout], warmup=1, steps=2)
    single, pipeline = rows
    assert single["vs_single"] == 1.0 and single["bubble"] is None
    assert math.isfinite(pipeline["vs_single"]) and pipeline["vs_single"] > 0
    assert pipeline["theory"] == pytest.approx(1 / 3)
    # Each rank computed during part of its step, and idled during part: a hook that timed nothing gives 1.0.
    assert len(pipeline["rank_bubbles"]) == 2
    assert all(0.0 < bubble < 1.0 for bubble in pipeline["rank_bubbles"]), pipeline["rank_bubbles"]
    assert len(pipeline["rank_compute"]) == 2 and all(seconds > 0 for seconds in pipeline["rank_compute"])
    bench.report(rows)
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["single", layout]
    assert f"{pipeline['bubble']:.3f}" in table[2] and "0.333" in table[2]
