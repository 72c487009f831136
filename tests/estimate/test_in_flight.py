"""The activations a pipeline rank holds at once, walked along torch's own action lists."""

from __future__ import annotations

from xscale.config.load import load_config
from xscale.estimate.in_flight import blocks_in_flight, schedule_actions


def pipeline_config(*overrides: str):
    return load_config(None, ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "parallel.pp=2",
                              "parallel.microbatches=4", *overrides])


ONE_BLOCK_EACH = [[0], [1], [2], [3]]


def test_one_stage_schedules_hold_p_minus_rank_or_every_microbatch():
    assert blocks_in_flight(pipeline_config(), 2, [0, 1], [[0, 1], [2, 3]]) == [4.0, 2.0]  # 1F1B: 2 and 1 microbatch
    assert blocks_in_flight(pipeline_config("parallel.pp_schedule=gpipe"), 2, [0, 1], [[0, 1], [2, 3]]) == [8.0, 8.0]
    assert schedule_actions(pipeline_config(), 2) is None


def test_interleaved_ranks_hold_their_warmup_forwards():
    """Rank 0 runs 0F0 0F1 2F0 2F1 0F2 before its first backward (5 blocks alive), rank 1 1F0 1F1 3F0 (3)."""
    config = pipeline_config("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2")
    assert blocks_in_flight(config, 2, [0, 1, 0, 1], ONE_BLOCK_EACH) == [5.0, 3.0]


def test_zero_bubble_counts_blocks_waiting_for_their_weight_half_twice():
    """ZB-V's last rank holds the turn of the V: its tail 1I2 2I3 1I3 leaves stage 2's microbatch 3 and stage 1's
    microbatches 2 and 3 waiting for their weight halves (6 blocks' worth); rank 0's first stage frees at its input
    half (it runs whole), so it peaks at 5."""
    config = pipeline_config("parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2")
    actions = schedule_actions(config, 2)
    assert [str(action) for action in actions[1][-6:]] == ["1I2", "2I3", "1I3", "1W2", "2W3", "1W3"]
    assert blocks_in_flight(config, 2, [0, 1, 1, 0], ONE_BLOCK_EACH) == [5.0, 6.0]
