"""train.loggers: CSV rows on disk as they are logged, the old train.tensorboard switch, wandb offline (same run
after a resume) and a clear line when wandb is missing."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.cli import main
from xscale.config.load import load_config
from xscale.config.schema import ConfigError, TrainConfig
from xscale.train import loggers
from xscale.train.loggers import CsvLogger, build_loggers
from xscale.train.trainer import Trainer

TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.global_batch_size=4",
        "train.seq_len=16", "train.log_every=100", "train.plot=false", "train.progress=false",
        "train.peak_flops=1e12", "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0"]


def rows(path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_csv_has_a_header_and_a_row_per_step_on_disk_before_close(tmp_path):
    logger = CsvLogger(tmp_path)
    logger.log(1, {"train/loss": 3.0, "train/lr": 0.1})
    logger.log(2, {"train/loss": 2.5, "train/lr": 0.2})
    assert rows(tmp_path / "metrics.csv") == [{"step": "1", "train/loss": "3.0", "train/lr": "0.1"},
                                              {"step": "2", "train/loss": "2.5", "train/lr": "0.2"}]
    logger.log(3, {"train/loss": 2.0, "eval/loss": 2.2})  # a scalar first seen now widens the header
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,train/loss,train/lr,eval/loss"
    assert [row["eval/loss"] for row in rows(tmp_path / "metrics.csv")] == ["", "", "2.2"]
    logger.close()
    resumed = CsvLogger(tmp_path)  # a restart appends under the same header
    resumed.log(4, {"train/loss": 1.5, "train/lr": 0.3})
    resumed.close()
    assert [row["step"] for row in rows(tmp_path / "metrics.csv")] == ["1", "2", "3", "4"]
    assert (tmp_path / "metrics.csv").read_text().count("step,") == 1


def test_default_loggers_and_the_old_tensorboard_switch():
    assert TrainConfig().logger_names() == ["tensorboard", "jsonl"]  # as before train.loggers existed
    assert TrainConfig(tensorboard=False).logger_names() == ["jsonl"]
    assert TrainConfig(loggers=["csv"], tensorboard=True).logger_names() == ["tensorboard", "csv"]
    assert TrainConfig(loggers=["csv", "tensorboard"]).logger_names() == ["csv", "tensorboard"]
    with pytest.raises(ConfigError, match="train.loggers: 'csvv' is not one of .*did you mean 'csv'"):
        load_config(None, ["train.loggers=[jsonl, csvv]"])
    with pytest.raises(ConfigError, match="names an entry twice"):
        load_config(None, ["train.loggers=[jsonl, jsonl]"])


def test_a_run_writes_each_chosen_logger_and_only_those(tmp_path):
    Trainer(load_config(None, [*TINY, "train.steps=2", "train.loggers=[csv]", f"train.output_dir={tmp_path}"])).fit()
    assert [row["step"] for row in rows(tmp_path / "metrics.csv")] == ["1", "2"]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_missing_wandb_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"pip install 'xscale\[wandb\]'"):
        build_loggers(["wandb"], tmp_path, {})
    assert main(["train", *TINY, "train.loggers=[jsonl, wandb]", f"train.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.loggers names wandb, which is not installed" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed (pip install 'xscale[wandb]'): the offline run is not tested")
def test_wandb_offline_run_continues_after_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = [*TINY, "train.loggers=[wandb, jsonl]", f"train.output_dir={tmp_path}"]
    Trainer(load_config(None, [*run, "train.steps=2"])).fit()
    meta = Checkpointer.read_meta(tmp_path / "checkpoints" / "step_00000002")
    run_id = meta["loggers"]["wandb"]["run_id"]
    resumed = Trainer(load_config(None, [*run, "train.steps=3", "train.schedule_steps=2"]))
    resumed.fit()
    assert resumed.metrics.loggers["wandb"].run_id == run_id
    assert Checkpointer.read_meta(tmp_path / "checkpoints" / "step_00000003")["loggers"]["wandb"]["run_id"] == run_id
    offline_runs = sorted(path.name for path in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(name.endswith(run_id) for name in offline_runs)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    wandb_logger = resumed.metrics.loggers["wandb"]
    assert isinstance(wandb_logger, loggers.ScalarLogger) and isinstance(wandb_logger, loggers.ResumableLogger)
    assert not isinstance(resumed.metrics.loggers["jsonl"], loggers.ResumableLogger)
