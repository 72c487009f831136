"""Learning-rate schedules at known steps (values computed by hand from the formulas), and the warning a resumed
run gives when its schedule is not the checkpoint's."""

from __future__ import annotations

import pytest

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.config.load import load_config
from xscale.config.schema import ConfigError, TrainConfig
from xscale.train.schedule import lr_factor, saved_schedule, schedule_change, schedule_parameters
from xscale.train.trainer import Trainer

# warmup 2 steps, then 10 steps of decay to 0.1 (steps 2..12), floor afterwards
BASE = {"steps": 12, "warmup_steps": 2, "min_lr_ratio": 0.1}

CASES = {
    # schedule name, extra fields: {step: factor}
    "cosine": ({"schedule": "cosine"}, {0: 0.5, 1: 1.0, 2: 1.0, 7: 0.55, 12: 0.1, 30: 0.1}),
    "linear": ({"schedule": "linear"}, {0: 0.5, 2: 1.0, 4: 0.82, 7: 0.55, 12: 0.1}),
    "constant": ({"schedule": "constant"}, {0: 0.5, 1: 1.0, 7: 1.0, 30: 1.0}),
    # decay over the last 4 of 12 steps (8..12): progress 0.25 at step 9, 0.5 at 10
    "wsd linear": ({"schedule": "wsd", "decay_steps": 4, "decay_shape": "linear"},
                   {0: 0.5, 1: 1.0, 5: 1.0, 8: 1.0, 9: 0.775, 10: 0.55, 12: 0.1, 30: 0.1}),
    "wsd cosine": ({"schedule": "wsd", "decay_steps": 4, "decay_shape": "cosine"},
                   {7: 1.0, 9: 0.1 + 0.9 * 0.5 * (1 + 0.5**0.5), 10: 0.55, 12: 0.1}),
    "wsd sqrt": ({"schedule": "wsd", "decay_steps": 4, "decay_shape": "sqrt"},
                 {8: 1.0, 9: 0.55, 11: 0.1 + 0.9 * (1 - 0.75**0.5), 12: 0.1}),
    # no decay_steps: the last 20% of 100 steps, 80..100
    "wsd default decay": ({"schedule": "wsd", "steps": 100}, {79: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}),
    # the decay is defined over schedule_steps, not the (longer) steps
    "cosine over schedule_steps": ({"schedule": "cosine", "steps": 24, "schedule_steps": 12},
                                   {7: 0.55, 12: 0.1, 20: 0.1}),
}


@pytest.mark.parametrize("case", CASES)
def test_factor_at_known_steps(case):
    fields, expected = CASES[case]
    train = TrainConfig(**{**BASE, **fields})
    assert {step: lr_factor(step, train) for step in expected} == pytest.approx(expected, abs=1e-12)


def test_the_decay_must_fit_and_decay_steps_needs_wsd():
    with pytest.raises(ConfigError, match="train.decay_steps=11 plus train.warmup_steps=2 exceed"):
        load_config(None, ["train.steps=12", "train.warmup_steps=2", "train.schedule=wsd", "train.decay_steps=11"])
    with pytest.raises(ConfigError, match="train.decay_steps=4 applies to train.schedule=wsd only"):
        load_config(None, ["train.decay_steps=4"])


def test_schedule_change_names_what_changed_and_how_to_keep_the_curve():
    saved = schedule_parameters(TrainConfig(**BASE))
    assert schedule_change(saved, TrainConfig(**BASE), step=6) is None
    assert schedule_change(saved, TrainConfig(**{**BASE, "steps": 24, "schedule_steps": 12}), step=6) is None
    line = schedule_change(saved, TrainConfig(**{**BASE, "steps": 24}), step=6)
    assert "\n" not in line
    assert "schedule_steps 12 -> 24" in line and "from step 6 on" in line and "set train.schedule_steps=12" in line
    line = schedule_change(saved, TrainConfig(**{**BASE, "schedule": "wsd", "decay_steps": 4}), step=6)
    assert "schedule cosine -> wsd" in line and "decay_steps None -> 4" in line and "train.schedule=cosine" in line


def test_a_checkpoint_without_schedule_parameters_reads_them_from_its_config():
    meta = {"config": {"train": {**BASE, "schedule": "linear", "lr": 1e-3}}}
    assert saved_schedule(meta) == schedule_parameters(TrainConfig(**{**BASE, "schedule": "linear"}))
    assert saved_schedule({"schedule": {"schedule": "constant"}}) == {"schedule": "constant"}


TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.global_batch_size=4",
        "train.seq_len=16", "train.warmup_steps=1", "train.log_every=100", "train.loggers=[]", "train.plot=false",
        "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy", "data.num_samples=64",
        "data.eval_fraction=0.0"]


def test_resuming_with_more_steps_warns_once_and_schedule_steps_keeps_the_curve(tmp_path, capsys):
    Trainer(load_config(None, [*TINY, "train.steps=3", f"train.output_dir={tmp_path}"])).fit()
    capsys.readouterr()
    meta = Checkpointer.read_meta(tmp_path / "checkpoints" / "step_00000003")
    assert meta["schedule"] == {"schedule": "cosine", "warmup_steps": 1, "schedule_steps": 3, "min_lr_ratio": 0.1}
    raised = Trainer(load_config(None, [*TINY, "train.steps=5", f"train.output_dir={tmp_path}"]))
    assert raised.resume() and raised.step == 3
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "schedule_steps 3 -> 5" in warnings[0]
    assert "set train.schedule_steps=3" in warnings[0]
    raised.lock.release()
    kept = Trainer(load_config(None, [*TINY, "train.steps=5", "train.schedule_steps=3", f"train.output_dir={tmp_path}"]))
    assert kept.resume()
    assert "warning" not in capsys.readouterr().out
    assert kept.scheduler.get_last_lr()[0] == pytest.approx(kept.config.train.lr * 0.1)  # step 3: the old floor
    kept.lock.release()
