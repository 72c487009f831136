"""The metrics log: each step's record is on disk as soon as it is logged (a crash loses none of the curve)."""

from __future__ import annotations

import json
import time

import matplotlib
import pytest

from xscale.config.load import load_config
from xscale.config.schema import TrainConfig
from xscale.data import build_datasets
from xscale.train.metrics import MetricsLogger, loss_figure
from xscale.train.trainer import Trainer, evaluation_interval

matplotlib.use("Agg")


def test_each_logged_step_is_on_disk_before_the_logger_closes(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=3, log_every=100, loggers=["jsonl"], progress=False)
    for step in (1, 2):
        logger.log(step, {"train/loss": 4.0 - step})
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # read while the logger still holds the file
        assert [json.loads(line)["step"] for line in lines] == list(range(1, step + 1))


def tensorboard_steps(folder) -> list[int]:
    """The steps of train/loss in the TensorBoard events on disk now."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder)).Reload()
    return [event.step for event in events.Scalars("train/loss")] if "train/loss" in events.Tags()["scalars"] else []


@pytest.fixture
def slow_disk(monkeypatch):
    """Each TensorBoard record takes 10 ms to write (a network file system): unflushed events are not on disk yet."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    write = RecordWriter.write

    def slow_write(self, data):
        time.sleep(0.01)
        write(self, data)

    monkeypatch.setattr(RecordWriter, "write", slow_write)


def test_flush_puts_the_tensorboard_events_on_disk(tmp_path, slow_disk):
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=3, log_every=100, loggers=["tensorboard", "jsonl"],
                           progress=False)
    for step in (1, 2):
        logger.log(step, {"train/loss": 4.0 - step})
    logger.flush()
    assert tensorboard_steps(tmp_path / "tensorboard") == [1, 2]
    logger.close(plot=False)


def test_each_checkpoint_has_the_tensorboard_curve_up_to_it_on_disk(tmp_path, slow_disk):
    config = load_config(None, [
        "model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.steps=4",
        "train.global_batch_size=4", "train.seq_len=16", "train.log_every=100", "train.tensorboard=true",
        "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0", "checkpoint.every=2", f"train.output_dir={tmp_path}"])
    trainer = Trainer(config)
    save, on_disk = trainer.checkpointer.save, {}

    def save_and_look(step, state, meta, *per_rank):
        on_disk[step] = tensorboard_steps(tmp_path / "tensorboard")  # what a crash during this save would leave
        return save(step, state, meta, *per_rank)

    trainer.checkpointer.save = save_and_look
    trainer.fit()
    assert on_disk == {2: [1, 2], 4: [1, 2, 3, 4]}


def test_flush_after_close_is_harmless(tmp_path):
    """A checkpoint saved after the run's end (e.g. by a caller of Trainer.save) flushes a closed logger."""
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=1, log_every=1, loggers=["tensorboard", "jsonl"],
                           progress=False)
    logger.log(1, {"train/loss": 1.0})
    logger.close(plot=False)
    logger.flush()


class SlowDataset:
    """Each sample takes ``delay`` seconds to read (a slow disk or tokenizer)."""

    def __init__(self, dataset, delay: float) -> None:
        self.dataset, self.delay = dataset, delay

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.delay)
        return self.dataset[index]


def test_step_time_counts_the_wait_for_data(tmp_path):
    """tokens/s is honest: a step that waits for its batch counts the wait (the first step has nothing read ahead)."""
    config = load_config(None, [
        "model.vocab_size=48", "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "train.steps=2",
        "train.global_batch_size=4", "train.seq_len=8", "train.peak_flops=1e12", "train.progress=false",
        "data.dataset=copy", "data.num_samples=16", "data.eval_fraction=0.0", f"train.output_dir={tmp_path}"])
    train_dataset = build_datasets(config)[0]
    trainer = Trainer(config, SlowDataset(train_dataset, delay=0.05), None)
    first = trainer.train_step()
    trainer.prefetcher.close()
    trainer.lock.release()
    assert first["perf/data_seconds"] >= 4 * 0.05
    assert first["perf/step_seconds"] >= first["perf/data_seconds"]
    assert first["perf/tokens_per_second"] <= 4 * 8 / (4 * 0.05)


def test_a_language_model_plot_is_one_panel_in_nats_per_token():
    history = [{"step": step, "train/loss": 5.0 / step} for step in range(1, 5)] + [{"step": 4, "eval/loss": 1.5}]
    figure = loss_figure(history)
    assert [axis.get_ylabel() for axis in figure.axes] == ["loss (nats/token)"]
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["train", "eval"]


def test_a_classifier_plot_has_an_accuracy_panel_in_percent():
    history = [{"step": 1, "train/loss": 0.7}, {"step": 2, "train/loss": 0.5, "eval/loss": 0.6, "eval/accuracy": 0.75}]
    figure = loss_figure(history, "nats/example")
    assert [axis.get_ylabel() for axis in figure.axes] == ["loss (nats/example)", "accuracy (%)"]
    assert list(figure.axes[1].get_lines()[0].get_ydata()) == [75.0]


def test_an_unset_eval_every_evaluates_about_ten_times_when_there_is_an_eval_split():
    assert evaluation_interval(TrainConfig(), eval_examples=100) == 20  # the default 200 steps: 10 evaluations
    assert evaluation_interval(TrainConfig(steps=50), eval_examples=100) == 10  # never more often than every 10
    assert evaluation_interval(TrainConfig(), eval_examples=0) == 0  # no eval split: nothing to evaluate
    assert evaluation_interval(TrainConfig(eval_every=0), eval_examples=100) == 0  # asked for none
    assert evaluation_interval(TrainConfig(eval_every=7), eval_examples=100) == 7
