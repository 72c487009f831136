"""A checkpoint read back on one process, and the tokenizer its run used."""

from __future__ import annotations

import shutil

import pytest
import torch

from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.trained import load_tokenizer, load_trained_model, tokenizer_path
from xscale.config.schema import ConfigError
from xscale.data.fixed_vocab import FixedVocab


def test_step_dir_root_and_run_dir_load_the_same_weights(trained_run):
    step_dir = trained_run / "checkpoints" / "step_00000003"
    models = [load_trained_model(path) for path in (step_dir, trained_run / "checkpoints", trained_run)]
    assert {trained.step_dir for trained in models} == {step_dir}
    weights = [trained.model.embedding.weight for trained in models]
    assert all(torch.equal(weights[0], other) for other in weights[1:])
    assert not models[0].model.training


def test_the_checkpoint_carries_its_tokenizer_and_an_older_one_finds_it_beside_a_moved_run(trained_run, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(trained_run, moved)
    trained = load_trained_model(moved)
    assert tokenizer_path(trained) == trained.step_dir / "tokenizer" / "text-400.model"  # the checkpoint's own copy
    del trained.meta["tokenizer"]  # as a checkpoint written before checkpoints carried their tokenizer
    assert tokenizer_path(trained) == moved / "tokenizer" / "text-400.model"
    shutil.rmtree(moved / "tokenizer")
    elsewhere = [f"train.output_dir={tmp_path / 'elsewhere'}"]  # the run's own output_dir would still hold it
    older = load_trained_model(moved, elsewhere)
    del older.meta["tokenizer"]
    with pytest.raises(ConfigError, match="no tokenizer found .*--tokenizer"):
        load_tokenizer(older)


def test_overrides_apply_and_a_task_run_uses_its_vocabulary(trained_run):
    trained = load_trained_model(trained_run, ["data.dataset=copy", "data.eval_fraction=0"])
    assert trained.config.data.dataset.kind == "copy"
    assert isinstance(load_tokenizer(trained), FixedVocab)


def test_missing_checkpoint_says_what_to_give(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; give a step directory"):
        load_trained_model(tmp_path / "absent")
