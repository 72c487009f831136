"""What a person wants to see while training: loss, tokens/s, MFU, memory, ETA.

Console lines (and a rich progress bar on a terminal), TensorBoard scalars, and a loss-curve
PNG at the end. Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from xscale.config import ModelConfig


def flops_per_token(model: ModelConfig, seq_len: int, num_params: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 * L * T * d for attention scores
    (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B). N excludes the embedding lookup."""
    layers = model.n_layers + (model.decoder_layers if model.family == "encoder_decoder" else 0)
    return 6.0 * num_params + 12.0 * layers * seq_len * model.d_model


def measure_matmul_peak(dtype: torch.dtype = torch.float32, size: int = 1024, device: str = "cpu") -> float:
    """Achieved FLOP/s of a square matmul on this device: the denominator of MFU when no peak is given."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    repeats, start = 0, time.perf_counter()
    while repeats < 3 or time.perf_counter() - start < 0.3:
        a @ b
        repeats += 1
    if device != "cpu":
        torch.cuda.synchronize()
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)


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
    """Collects per-step scalars; prints, writes TensorBoard and a JSONL log, plots at the end."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, total_steps: int, log_every: int,
                 tensorboard: bool, progress: bool) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.history: list[dict[str, Any]] = []
        self.writer = None
        self.progress = None
        self._start = time.perf_counter()
        self._first_step: int | None = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Line-buffered: every record is on disk once logged, so a crash loses no step of the loss curve.
        self._jsonl = (self.output_dir / "metrics.jsonl").open("a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: scalars go to metrics.jsonl only", flush=True)
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self.progress.start()
            self._task = self.progress.add_task("train", total=total_steps, status="")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record the scalars of optimizer step ``step`` (1-based)."""
        if self._first_step is None:
            self._first_step = step - 1
            self._start = time.perf_counter()
        record = {"step": step, **scalars}
        self.history.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in scalars.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
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
        if not self.enabled or self._jsonl.closed:  # closed: everything is on disk already
            return
        self._jsonl.flush()
        if self.writer is not None:
            self.writer.flush()

    def _format(self, step: int, s: dict[str, float], eta: float) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        if "train/loss" in s:
            parts.append(f"loss {s['train/loss']:.4f}")
        if "eval/loss" in s:
            parts.append(f"eval {s['eval/loss']:.4f}")
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
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self._jsonl.close()
        return self.plot() if plot else None

    def plot(self) -> Path | None:
        """Write loss_curve.png (train and eval loss against step)."""
        train = [(r["step"], r["train/loss"]) for r in self.history if "train/loss" in r]
        if not train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot(*zip(*train), label="train")
        evaluation = [(r["step"], r["eval/loss"]) for r in self.history if "eval/loss" in r]
        if evaluation:
            axis.plot(*zip(*evaluation), "o-", label="eval")
        axis.set_xlabel("step")
        axis.set_ylabel("loss (nats/token)")
        axis.set_title("xscale training loss")
        axis.grid(alpha=0.3)
        axis.legend()
        path = self.output_dir / "loss_curve.png"
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path
