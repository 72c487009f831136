"""Checkpoints written by earlier releases (tests/data/checkpoints: before the layered redesign, commit 74b7b17, and
before components took {kind, options}, commit 163e901) resume: the model, optimizer, schedule and sampler state
load, and steps 4-6 repeat the uninterrupted run's losses; a saved config with the old flat keys reads as the new."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.commands.parity import PARITY_SETTINGS, train_losses
from xscale.config.load import config_from_dict, load_config

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
# The losses were recorded on another machine's CPU: its float rounding may differ from this one's, far below
# what a missing or misnamed tensor changes (a fresh init moves step 4's loss by > 1e-2).
RTOL = 1e-4


@pytest.mark.parametrize("name", ["decoder_single", "encoder_decoder_pp2", "reversible_flat_keys"])
def test_a_checkpoint_from_before_the_redesign_resumes_on_one_process(name, tmp_path):
    expected = json.loads((DATA / name / "expected.json").read_text())
    run = tmp_path / "run"
    shutil.copytree(DATA / name, run / "checkpoints", ignore=shutil.ignore_patterns("expected.json"))
    overrides = [o for o in expected["overrides"] if not o.startswith("parallel.")]  # resumed on one process
    config = load_config(None, [*overrides, *PARITY_SETTINGS, "train.steps=6", f"train.output_dir={run}"])
    config.checkpoint.resume = "auto"
    losses = train_losses(config, 1)
    assert len(losses) == 3, "the run must resume after step 3"
    for step, (want, got) in enumerate(zip(expected["losses_after_resume"], losses, strict=True), start=4):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} after resume vs {want} before the redesign"


def test_the_saved_config_of_the_previous_release_reads_its_flat_keys_as_component_options(capsys):
    """163e901 saved model.rope_theta and model.norm_eps; they read as the options of model.position and model.norm,
    and its stack switches (model.reversible=true, model.act=false, ...) as model.stack, with one deprecation line
    each."""
    meta = Checkpointer.read_meta(DATA / "reversible_flat_keys" / "step_00000003")
    assert meta["config"]["model"]["rope_theta"] == 5000.0  # as written by that release
    model = config_from_dict(meta["config"]).model
    assert (model.position.kind, model.position.options) == ("rope", {"theta": 5000.0})
    assert (model.norm.kind, model.norm.options) == ("layernorm", {"eps": 1e-6})
    assert (model.stack.kind, model.stack.options) == ("reversible", {})
