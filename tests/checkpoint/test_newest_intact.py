"""checkpoint.resume=auto falls back past damaged checkpoints to the newest one that verifies: each damaged one is
moved aside (never deleted) with one warning line; with none intact the newest's error stands and nothing moves."""

import shutil

import pytest
import torch

from xscale.checkpoint.checkpointer import META, Checkpointer, CheckpointError


@pytest.fixture
def three_steps(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    for step in (2, 4, 6):
        checkpointer.save(step, {"model": {"w": torch.full((4,), float(step))}}, {"sampler": {}})
    return tmp_path


def _warnings(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if "is damaged" in line]


def test_an_intact_latest_is_taken_as_it_is(three_steps, capsys):
    assert Checkpointer(three_steps).newest_intact() == three_steps / "step_00000006"
    assert not _warnings(capsys)


def test_two_damaged_newest_are_moved_aside_and_the_third_resumed(three_steps, capsys):
    (three_steps / "step_00000006" / META).write_text("{not json")
    shard = next((three_steps / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    found = Checkpointer(three_steps).newest_intact()
    assert found == three_steps / "step_00000002"
    warnings = _warnings(capsys)
    assert len(warnings) == 2 and "step_00000006" in warnings[0] and "not JSON" in warnings[0]
    assert "step_00000004" in warnings[1] and "truncated" in warnings[1]
    assert sorted(p.name for p in three_steps.glob("damaged-*")) == ["damaged-step_00000004", "damaged-step_00000006"]
    assert (three_steps / "latest").read_text().strip() == "step_00000002"
    state = {"model": {"w": torch.zeros(4)}}
    Checkpointer(three_steps).load(found, state)
    assert torch.equal(state["model"]["w"], torch.full((4,), 2.0))


def test_latest_naming_a_directory_that_is_gone_falls_back_too(three_steps, capsys):
    shutil.rmtree(three_steps / "step_00000006")
    assert Checkpointer(three_steps).newest_intact() == three_steps / "step_00000004"
    assert "it does not exist" in _warnings(capsys)[0]


def test_with_none_intact_the_newest_error_stands_and_nothing_moves(three_steps, capsys):
    for step in (2, 4, 6):
        (three_steps / f"step_{step:08d}" / META).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step_00000006/meta.json is corrupt"):
        Checkpointer(three_steps).newest_intact()
    assert not list(three_steps.glob("damaged-*")) and not _warnings(capsys)
    assert (three_steps / "latest").read_text().strip() == "step_00000006"
