"""Where a run's per-step scalars go (``train.loggers``): TensorBoard events, a JSONL and a CSV file, Weights & Biases.

Each logger is one small class behind :class:`ScalarLogger`. The files are written line by line (line-buffered),
so a crash loses no logged step; TensorBoard buffers its events until :meth:`ScalarLogger.flush`.
A logger with state a resumed run must continue (the wandb run id) returns it from ``state_dict`` and the trainer
keeps it in each checkpoint's meta.json.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from xscale.config.check import register_check
from xscale.config.schema import Config, ConfigError

WANDB_INSTALL = "pip install 'xscale[wandb]'"


@runtime_checkable
class ScalarLogger(Protocol):
    """A destination of per-step scalars (rank 0 only)."""

    def log(self, step: int, scalars: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ResumableLogger(Protocol):
    """A logger whose run a resumed job continues (wandb): its state goes into each checkpoint's meta.json."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JsonlLogger:
    """``metrics.jsonl``: one JSON object per logged step, appended across restarts."""

    def __init__(self, output_dir: Path) -> None:
        self.file = (output_dir / "metrics.jsonl").open("a", buffering=1)

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **scalars}) + "\n")

    def flush(self) -> None:
        if not self.file.closed:
            self.file.flush()

    def close(self) -> None:
        self.file.close()


class CsvLogger:
    """``metrics.csv``: a header, then one row per logged step (appended across restarts). A scalar first seen
    after the header was written (the first evaluation's ``eval/loss``) rewrites the file with a wider header."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / "metrics.csv"
        self.columns: list[str] = []
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open(newline="") as handle:
                self.columns = next(csv.reader(handle), [])
        self.file = self.path.open("a", newline="", buffering=1)

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        row = {"step": step, **scalars}
        new = [key for key in row if key not in self.columns]
        if new:
            self._widen(self.columns + new if self.columns else list(row))
        csv.DictWriter(self.file, self.columns, restval="").writerow(row)

    def _widen(self, columns: list[str]) -> None:
        """Rewrite the file under ``columns`` (atomically: a crash leaves the old file or the new one)."""
        self.file.close()
        with self.path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        temporary = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with temporary.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, self.path)
        self.columns = columns
        self.file = self.path.open("a", newline="", buffering=1)

    def flush(self) -> None:
        if not self.file.closed:
            self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """TensorBoard scalars under ``<output_dir>/tensorboard``."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        for key, value in scalars.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (``pip install 'xscale[wandb]'``; ``WANDB_PROJECT``, ``WANDB_MODE=offline`` etc. as
    wandb reads them). The run starts at the first logged step, so a resumed run can first hand over the id its
    checkpoint kept (:meth:`load_state_dict`) and continue the same wandb run."""

    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb, self.output_dir, self.config = wandb, output_dir, config
        self.run_id = uuid.uuid4().hex[:16]
        self.run: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.run is None and state.get("run_id"):
            self.run_id = str(state["run_id"])

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        if self.run is None:
            self.run = self.wandb.init(id=self.run_id, resume="allow", dir=str(self.output_dir),
                                       project=os.environ.get("WANDB_PROJECT", "xscale"),
                                       name=self.output_dir.name, config=self.config)
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass  # wandb's service process streams the records itself

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def check_installed(names: list[str]) -> None:
    """Refuse a logger whose package is missing, with the one line that installs it (before anything runs)."""
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.loggers names wandb, which is not installed: {WANDB_INSTALL}")


def build_loggers(names: list[str], output_dir: Path, config: dict[str, Any]) -> dict[str, ScalarLogger]:
    """The loggers ``names`` (train.loggers, in order) writing under ``output_dir``."""
    check_installed(names)
    makers = {"jsonl": lambda: JsonlLogger(output_dir), "csv": lambda: CsvLogger(output_dir),
              "tensorboard": lambda: TensorBoardLogger(output_dir), "wandb": lambda: WandbLogger(output_dir, config)}
    loggers: dict[str, ScalarLogger] = {}
    for name in names:
        try:
            loggers[name] = makers[name]()
        except ImportError:  # tensorboard is a dependency; an environment without it still trains
            print(f"{name} is not installed: its scalars are not written", flush=True)
    return loggers


def check_loggers_installed(config: Config) -> None:
    """The config check :func:`check_installed` (an optional logger's package, before anything runs)."""
    check_installed(config.train.logger_names())


register_check("xscale.train", check_loggers_installed)
