"""The stream data order (data.order=streams): each stream's consecutive windows on one rank and batch row."""

from __future__ import annotations

import pytest

from xscale.data.sampler import GlobalSampler, StreamSampler


@pytest.mark.parametrize("dp_size, microbatches", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_each_stream_stays_on_its_rank_and_row_reading_consecutive_windows(dp_size, microbatches):
    sampler = StreamSampler(num_samples=43, global_batch_size=8, seed=0)  # 8 streams of 5 windows, 3 unread
    seen: dict[tuple[int, int], list[int]] = {}
    for step in range(sampler.stream_length):
        batch = sampler.batch_indices(step)
        for rank in range(dp_size):
            for row, window in enumerate(GlobalSampler.shard(batch, rank, dp_size, microbatches)):
                seen.setdefault((rank, row), []).append(window)
    assert len(seen) == 8
    for windows in seen.values():
        assert windows == list(range(windows[0], windows[0] + 5))  # consecutive windows of one stream
    assert sorted(w for windows in seen.values() for w in windows) == list(range(40))


def test_streams_restart_together_and_resume_at_the_saved_step():
    sampler = StreamSampler(num_samples=20, global_batch_size=4, seed=0)
    assert [step for step in range(12) if sampler.starts_streams(step)] == [0, 5, 10]
    assert sampler.step_indices(5) == sampler.step_indices(0) == [0, 5, 10, 15]
    sampler.batch_indices(0), sampler.batch_indices(1)
    resumed = StreamSampler(num_samples=20, global_batch_size=4, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.next_step == 2 and resumed.step_indices(2) == [2, 7, 12, 17]


def test_resuming_with_other_streams_is_refused():
    saved = StreamSampler(num_samples=20, global_batch_size=4, seed=0).state_dict()
    with pytest.raises(ValueError, match="train.global_batch_size=4"):
        StreamSampler(num_samples=20, global_batch_size=2, seed=0).load_state_dict(saved)
    with pytest.raises(ValueError, match="data.order=streams"):
        StreamSampler(num_samples=20, global_batch_size=4, seed=0).load_state_dict(
            GlobalSampler(20, 4, seed=0).state_dict())
