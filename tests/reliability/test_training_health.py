"""A model destroyed by a huge learning rate (loss far up, then NaN) never rotates out the last healthy checkpoint,
and the stop message names it."""

from __future__ import annotations

import pytest

import xscale.train.trainer as trainer_module
from xscale.config.load import load_config
from xscale.train.trainer import NonFiniteTraining, Trainer

TINY = [
    "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
    "train.global_batch_size=4", "train.seq_len=16", "train.warmup_steps=0", "train.log_every=100",
    "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.schedule=constant",
    "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0",
    "train.steps=12", "checkpoint.every=1", "checkpoint.keep=2",
]
HEALTHY_STEPS = 3


@pytest.fixture
def huge_lr_from_step_4(monkeypatch):
    """lr 1e-3 for three steps, then 25: the loss jumps ~500x at once and is NaN a few steps later."""
    monkeypatch.setattr(trainer_module, "lr_factor", lambda step, train: 1.0 if step < HEALTHY_STEPS else 25_000.0)


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_the_last_healthy_checkpoint_is_kept_and_named(tmp_path, huge_lr_from_step_4, on_nonfinite, capsys):
    config = load_config(None, [*TINY, f"train.output_dir={tmp_path}", f"train.on_nonfinite={on_nonfinite}",
                                "train.max_skipped=1"])
    trainer = Trainer(config)
    with pytest.raises(NonFiniteTraining) as error:
        trainer.fit()
    root = tmp_path / "checkpoints"
    # step 4 is the first update at lr 25; its loss, of step 3's weights, is still fine: step 3 is the last healthy
    healthy = root / f"step_{HEALTHY_STEPS:08d}"
    message = str(error.value)
    assert trainer.step > HEALTHY_STEPS + 2, message  # unhealthy checkpoints were written after it
    assert healthy.is_dir(), sorted(p.name for p in root.iterdir())
    assert f"Resume from {healthy}, the last checkpoint confirmed healthy" in message
    assert ("train.on_nonfinite=skip" in message) == (on_nonfinite == "stop")
    assert f"{healthy}, the last checkpoint confirmed healthy, is kept from rotation" in capsys.readouterr().out
