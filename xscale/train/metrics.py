"""What a person wants to see while training: loss, tokens/s, MFU, memory, ETA.

Console lines (and a rich progress bar on a terminal), the scalars to each of ``train.loggers`` (TensorBoard, JSONL,
CSV, wandb: :mod:`xscale.train.loggers`), and a loss-curve PNG at the end. Only rank 0 writes.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from xscale.config.schema import ModelConfig
from xscale.models.stacks import extra_blocks
from xscale.train.loggers import ResumableLogger, ScalarLogger, build_loggers


def flops_per_token(model: ModelConfig, seq_len: int, num_params: float) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 * L * T * d for attention scores
    (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B). N: the weights a token multiplies by, the LM head's
    included and the embedding lookup not (a MoE layer's top-k experts, not all:
    :attr:`~xscale.models.parameters.ModelCount.matmul_per_token`).
    L counts a funnel's decoder blocks too (full length; its pooled groups are counted at full length)."""
    layers = model.total_layers + extra_blocks(model)
    return 6.0 * num_params + 12.0 * layers * seq_len * model.d_model


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Collects per-step scalars; prints them, hands them to the ``train.loggers``
    (:mod:`xscale.train.loggers`) and plots at the end."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, total_steps: int, log_every: int,
                 loggers: list[str], progress: bool, config: dict[str, Any] | None = None,
                 loss_unit: str = "nats/token") -> None:
        self.output_dir = Path(output_dir)
        self.loss_unit = loss_unit  # what the loss is averaged over: nats/token, or nats/example for a classifier
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.history: list[dict[str, Any]] = []
        self.loggers: dict[str, ScalarLogger] = {}
        self.progress = None
        self._start = time.perf_counter()
        self._first_step: int | None = None
        self._closed = False
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = build_loggers(loggers, self.output_dir, config or {})
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self.progress.start()
            self._task = self.progress.add_task("train", total=total_steps, status="")

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run's loggers continue from (the wandb run id), kept in each checkpoint's meta.json."""
        return {name: logger.state_dict() for name, logger in self.loggers.items()
                if isinstance(logger, ResumableLogger)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, logger in self.loggers.items():
            if name in state and isinstance(logger, ResumableLogger):
                logger.load_state_dict(state[name])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the scalars of optimizer step ``step`` (1-based)."""
        if self._first_step is None:
            self._first_step = step - 1
            self._start = time.perf_counter()
        self.history.append({"step": step, **scalars})
        if not self.enabled:
            return
        for logger in self.loggers.values():
            logger.log(step, scalars)
        done = step - self._first_step
        eta = (time.perf_counter() - self._start) / max(1, done) * (self.total_steps - step)
        line = self._format(step, scalars, eta)
        if self.progress is not None:
            self.progress.update(self._task, completed=step, status=line)
            if step % self.log_every == 0 or step == self.total_steps:
                self.progress.console.print(line)
        elif step % self.log_every == 0 or step == self.total_steps or step == 1:
            print(line, flush=True)

    def flush(self) -> None:
        """Put everything logged so far on disk: TensorBoard buffers events for up to two minutes."""
        if not self.enabled or self._closed:  # closed: everything is on disk already
            return
        for logger in self.loggers.values():
            logger.flush()

    def _format(self, step: int, s: dict[str, float], eta: float) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        if "train/loss" in s:
            parts.append(f"loss {s['train/loss']:.4f}")
        if "eval/loss" in s:
            parts.append(f"eval {s['eval/loss']:.4f}")
        if "eval/accuracy" in s:
            parts.append(f"acc {100 * s['eval/accuracy']:.1f}%")
        if "train/lr" in s:
            parts.append(f"lr {s['train/lr']:.2e}")
        if "train/grad_norm" in s:
            parts.append(f"grad {s['train/grad_norm']:.3f}")
        if "perf/tokens_per_second" in s:
            parts.append(f"{s['perf/tokens_per_second']:,.0f} tok/s")
        if "perf/mfu" in s:
            parts.append(f"MFU {100 * s['perf/mfu']:.1f}%")
        if "perf/memory_gb" in s:
            parts.append(f"mem {s['perf/memory_gb']:.2f} GB")
        parts.append(f"ETA {format_seconds(eta)}")
        return " | ".join(parts)

    def close(self, plot: bool) -> Path | None:
        if not self.enabled:
            return None
        if self.progress is not None:
            self.progress.stop()
        if not self._closed:
            for logger in self.loggers.values():
                logger.close()
            self._closed = True
        return self.plot() if plot else None

    def plot(self) -> Path | None:
        """Write loss_curve.png: train and eval loss against step, and a classifier's eval accuracy beside them."""
        if not any("train/loss" in record for record in self.history):
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = loss_figure(self.history, self.loss_unit)
        path = self.output_dir / "loss_curve.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path


def _curve(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(record["step"], record[key]) for record in history if key in record and math.isfinite(record[key])]


def loss_figure(history: list[dict[str, Any]], loss_unit: str = "nats/token"):
    """The figure of loss_curve.png (matplotlib with a backend chosen): loss against step in ``loss_unit``, and with
    eval/accuracy in ``history`` a second panel of it in percent."""
    import matplotlib.pyplot as plt

    accuracy = _curve(history, "eval/accuracy")
    figure, axes = plt.subplots(1, 2 if accuracy else 1, figsize=(12 if accuracy else 7, 4), squeeze=False)
    loss_axis = axes[0][0]
    loss_axis.plot(*zip(*_curve(history, "train/loss")), label="train")
    evaluation = _curve(history, "eval/loss")
    if evaluation:
        loss_axis.plot(*zip(*evaluation), "o-", label="eval")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel(f"loss ({loss_unit})")
    loss_axis.set_title("xscale training loss")
    loss_axis.grid(alpha=0.3)
    loss_axis.legend()
    if accuracy:
        accuracy_axis = axes[0][1]
        steps, values = zip(*accuracy)
        accuracy_axis.plot(steps, [100 * value for value in values], "o-", color="tab:green", label="eval")
        accuracy_axis.set_xlabel("step")
        accuracy_axis.set_ylabel("accuracy (%)")
        accuracy_axis.set_title("eval accuracy")
        accuracy_axis.grid(alpha=0.3)
        accuracy_axis.legend()
    figure.tight_layout()
    return figure
