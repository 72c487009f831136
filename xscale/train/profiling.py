"""Per-rank traces of a few training steps (``train.profile_start``, ``train.profile_steps``).

Each rank writes a Chrome trace (``torch.profiler``; open it in chrome://tracing or https://ui.perfetto.dev) to
``<output_dir>/profile/rank{r}.json``, and on CUDA a memory snapshot of the same steps
(``torch.cuda.memory._dump_snapshot``; open it in https://pytorch.org/memory_viz) to ``rank{r}_memory.pickle``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    """Profiles steps ``start`` .. ``start + steps - 1`` (1-based optimizer steps); ``steps=0`` does nothing."""

    def __init__(self, output_dir: str | Path, *, rank: int, start: int, steps: int, device: torch.device) -> None:
        self.directory = Path(output_dir) / "profile"
        self.rank, self.first, self.last = rank, start, start + steps - 1
        self.cuda = device.type == "cuda"
        self.profiler: profile | None = None

    @property
    def trace_path(self) -> Path:
        return self.directory / f"rank{self.rank}.json"

    def before_step(self, step: int) -> None:
        """Called before step ``step`` runs: the first profiled step starts the profiler."""
        if step != self.first or self.last < self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, record_shapes=True, with_stack=False)
        if self.cuda:
            torch.cuda.memory._record_memory_history()
        self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        """Called after step ``step`` ran: the last profiled step writes the trace."""
        if step == self.last:
            self.stop()

    def stop(self) -> None:
        """Write what was profiled (also when the run ends or stops before the last profiled step)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.trace_path))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.directory / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            print(f"xscale: profile of steps {self.first}-{self.last} written to {self.directory}/rank*.json",
                  flush=True)
