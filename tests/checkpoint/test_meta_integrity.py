"""meta.json is covered by its own checksum: random bytes, a hand-edited step or a step that disagrees with its
directory are one clear line, never a traceback or a silent rewind; a checkpoint from before the checksum loads."""

import json

import pytest
import torch

from xscale.checkpoint.checkpointer import META, Checkpointer, CheckpointError
from xscale.checkpoint.integrity import META_DIGEST


@pytest.fixture
def saved(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(3, {"model": {"w": torch.arange(4.0)}}, {"step": 3, "sampler": {"consumed_samples": 12}})
    return checkpointer.latest()


def test_a_saved_meta_reads_back_with_its_checksum(saved):
    meta = Checkpointer.read_meta(saved)
    assert meta["step"] == 3 and len(meta[META_DIGEST]) == 64


def test_random_bytes_are_one_line(saved):
    (saved / META).write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt \(not JSON: .*\); resume from another checkpoint"):
        Checkpointer.read_meta(saved)


def test_a_json_that_is_no_mapping_is_refused(saved):
    (saved / META).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="a JSON list, not a mapping"):
        Checkpointer.read_meta(saved)


def test_an_edited_field_breaks_the_checksum(saved):
    meta = json.loads((saved / META).read_text())
    meta["sampler"]["consumed_samples"] = 4  # the data position rewound by hand
    (saved / META).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="was changed after the save"):
        Checkpointer.read_meta(saved)


def test_a_step_other_than_the_directory_s_is_refused_without_a_checksum_too(saved):
    meta = json.loads((saved / META).read_text())
    meta["step"] = 1
    del meta[META_DIGEST]  # as in a checkpoint written before meta.json carried its checksum
    (saved / META).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="says step 1 but its directory is step_00000003"):
        Checkpointer.read_meta(saved)


def test_a_checkpoint_from_before_the_checksum_still_loads(saved):
    meta = json.loads((saved / META).read_text())
    del meta[META_DIGEST]
    (saved / META).write_text(json.dumps(meta))
    state = {"model": {"w": torch.zeros(4)}}
    assert Checkpointer(saved.parent).load(saved, state)["step"] == 3
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
