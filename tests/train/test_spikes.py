"""Loss spikes: one line naming the step and its batch's sample indices, a count in the metrics, never before the
history has a few steps, off with spike_factor=0."""

from __future__ import annotations

import json

import pytest

from xscale.config.load import load_config
from xscale.train import trainer as trainer_module
from xscale.train.spikes import MIN_HISTORY, LossSpikeDetector
from xscale.train.trainer import Trainer


def feed(detector: LossSpikeDetector, losses: list[float]) -> list[int]:
    return [detector.observe(step, loss, lambda step=step: [step * 10, step * 10 + 1])
            for step, loss in enumerate(losses, 1)]


def test_a_loss_above_factor_times_the_median_is_counted_and_named(capsys):
    detector = LossSpikeDetector(3.0, 50)
    counts = feed(detector, [2.0, 2.2, 1.8] * 3 + [6.5, 2.0, 6.0])
    assert counts == [0] * 9 + [1, 1, 1]  # 6.5 > 3 x 2.0; 6.0 is not
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["xscale: loss spike at step 10: loss 6.5000 > 3 x median 2.0000 of the last 9 steps; batch "
                     "samples [100, 101]"]


def test_nothing_is_judged_before_a_few_steps_of_history(capsys):
    detector = LossSpikeDetector(3.0, 50)
    assert feed(detector, [1.0] + [100.0] * (MIN_HISTORY - 1)) == [0] * MIN_HISTORY
    assert detector.observe(MIN_HISTORY + 1, 250.0, lambda: [0]) == 0  # judged now, against a median of 100
    assert capsys.readouterr().out == ""


def test_the_median_covers_only_the_last_window_losses():
    detector = LossSpikeDetector(3.0, 10)
    feed(detector, [10.0] * 10 + [1.0] * 10)  # the 10s have left the window
    assert detector.observe(21, 5.0, lambda: [0]) == 1


def test_an_earlier_spike_does_not_hide_the_next():
    """The median of [1 x 9, 50] is 1: 4.0 is a spike (a mean of 5.9 would have hidden it)."""
    detector = LossSpikeDetector(3.0, 50)
    assert feed(detector, [1.0] * 9 + [50.0, 4.0])[-2:] == [1, 2]


@pytest.mark.parametrize("factor,loss", [(0.0, 1e9), (3.0, float("nan")), (3.0, float("inf"))])
def test_off_or_non_finite_losses_are_never_spikes(factor, loss, capsys):
    detector = LossSpikeDetector(factor, 50)
    feed(detector, [1.0] * 10)
    assert detector.observe(11, loss, lambda: pytest.fail("no indices without a spike")) == 0
    assert capsys.readouterr().out == ""


def test_only_the_announcing_rank_prints(capsys):
    detector = LossSpikeDetector(3.0, 50, announce=False)
    assert feed(detector, [1.0] * 10 + [9.0])[-1] == 1
    assert capsys.readouterr().out == ""


def test_the_trainer_names_the_step_and_the_samples_of_its_batch(tmp_path, capsys, monkeypatch):
    config = load_config(None, [
        "model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.steps=12",
        "train.global_batch_size=4", "train.seq_len=16", "train.log_every=100", "train.tensorboard=false",
        "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0", f"train.output_dir={tmp_path}"])
    trainer = Trainer(config)
    real_step = trainer_module.forward_backward_step

    def spike_at_step_11(model, batch, context):  # the loss reported for step 11 is 100x the real one
        loss = real_step(model, batch, context)
        return loss * 100 if trainer.step == 10 else loss

    monkeypatch.setattr(trainer_module, "forward_backward_step", spike_at_step_11)
    trainer.fit()
    expected = trainer.sampler.batch_indices(10)  # step 11 reads the batch of 0-based step 10
    spikes = [line for line in capsys.readouterr().out.splitlines() if "loss spike" in line]
    assert len(spikes) == 1 and spikes[0].startswith("xscale: loss spike at step 11: ")
    assert spikes[0].endswith(f"batch samples {expected}")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["train/loss_spike"] for record in records] == [0] * 10 + [1, 1]
