"""``xscale bench parallel``: the bubble arithmetic, the compute clock, and a tiny run of one pipeline layout.

No timing is asserted (machines are noisy): ratios must be finite and positive, bubbles inside (0, 1).
"""

import math
import time

import pytest

from xscale.bench import parallel as bench
from xscale.config.load import load_config
from xscale.parallel.pipeline import ideal_bubble

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


def test_each_pure_data_parallel_layout_has_its_torch_peer():
    def peer(*overrides):
        return bench.peer_of(load_config(None, [*TINY, *overrides]))

    assert peer("parallel.dp_shard=2") == "torch-ddp"
    assert peer("parallel.dp_shard=2", "parallel.zero_stage=2") == "torch-ddp"
    assert peer("parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero_stage=1") == "torch-ddp"
    assert peer("parallel.dp_shard=2", "parallel.zero_stage=3") == "fsdp2"
    assert peer("parallel.dp_shard=1") is None  # one process: nothing to compare
    assert peer("parallel.dp_shard=1", "parallel.tp=2") is None
    assert peer("parallel.dp_shard=2", "parallel.pp=2", "parallel.microbatches=2") is None


@pytest.mark.slow  # three sets of fresh processes
def test_data_parallel_layouts_report_their_peers_in_the_same_run(capsys):
    rows = bench.measure_layouts(None, TINY, ["dp_shard=2", "dp_shard=2,zero_stage=3"], warmup=1, steps=2)
    single, ddp, zero3 = rows
    assert single["peer"] is None and single["vs_peer"] is None
    assert (ddp["peer"], zero3["peer"]) == ("torch-ddp", "fsdp2")
    for row in (ddp, zero3):
        assert math.isfinite(row["vs_peer"]) and row["vs_peer"] > 0 and row["peer_tokens_per_s"] > 0
        low, high = row["vs_peer_quartiles"]  # of the per-pair ratios, whose median is vs_peer
        assert low <= row["vs_peer"] <= high
        assert math.isfinite(row["ceiling"]) and row["ceiling"] > 0  # peer step / communication-free local step
    bench.report(rows)
    table = capsys.readouterr().out.splitlines()
    assert "xscale/peer" in table[0] and f"{zero3['vs_peer']:.2f}x" in table[3] and "fsdp2" in table[3]
    assert "ceiling" in table[0] and f"{ddp['ceiling']:.2f}x" in table[2]
