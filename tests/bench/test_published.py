"""The published-runs comparison (:mod:`xscale.bench.published`): Megatron's FLOP count by hand, and a prediction
that keeps the paper's degrees."""

import pytest

from xscale.bench.published import RUNS, megatron_flops, predict


def test_megatron_flops_by_hand():
    # 96 B s l h^2 (1 + s / 6h + V / 16 l h) with B=1, s=6, l=1, h=1, V=16: 96 x 6 x (1 + 1 + 1)
    assert megatron_flops(1, 6, 1, 1, 16) == 96 * 6 * 3


def test_prediction_keeps_the_published_degrees():
    run = next(run for run in RUNS if run.tp == 8 and run.pp == 1)
    row = predict(run)
    assert row["plan"].layout.tp == 8 and row["plan"].layout.pp == 1 and row["plan"].layout.zero_stage == 0
    assert row["predicted"] > 0 and row["error"] == pytest.approx(row["predicted"] / run.reported - 1)
