"""The faults of a chaos soak that only the worker itself can cause, and the timings the soak reads.

Active only when ``$XSCALE_CHAOS_PLAN`` names a plan (``xscale chaos`` sets it; :mod:`xscale.launcher.chaos`):
``xscale train`` then builds a :class:`FaultInjectingTrainer`, which

* writes its pid (``pids/rank_N.json``) so that the soak can signal this rank, and, on rank 0, the times it started,
  finished building and finished resuming (``events.jsonl``), so that a restart's time splits into its parts;
* at a ``nan`` fault's step makes the embedding's output NaN on rank 0 for that one forward (the trainer's
  non-finite check must stop the run before any update or checkpoint holds it);
* in the first save at or after a ``disk_full`` fault's step, fails the checkpoint's data write on rank 0 with
  ``ENOSPC`` after its first bytes, as a full disk does (the checkpointer must keep the previous checkpoint).

Each fault fires once: a marker under ``fired/`` keeps a restarted run that passes the step again from repeating it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from xscale.config.schema import Config
from xscale.launcher.chaos.plan import (
    JOB_VARIABLE,
    PLAN_VARIABLE,
    ChaosFiles,
    Fault,
    process_start_time,
    write_json_atomic,
)
from xscale.train.trainer import Trainer

BYTES_BEFORE_FULL = 64  # a full disk takes some bytes of a file before the write fails


def chaos_files() -> ChaosFiles | None:
    """The soak's files when this process runs under ``xscale chaos``, else None."""
    plan = os.environ.get(PLAN_VARIABLE)
    return ChaosFiles(Path(plan).parent) if plan else None


class FaultInjectingTrainer(Trainer):
    """A :class:`Trainer` that injects the plan's in-worker faults and records when it started, built and resumed."""

    def __init__(self, config: Config, files: ChaosFiles, **kwargs: Any) -> None:
        self.files = files
        self.faults = files.read_plan()
        rank = int(os.environ.get("RANK", "0"))
        self.identity = {"job": int(os.environ.get(JOB_VARIABLE, "0")),
                         "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid()}
        write_json_atomic(files.pid(rank), self.identity)
        if rank == 0:
            files.record_event("process", time=process_start_time(), **self.identity)
            files.record_event("start", **self.identity)
        super().__init__(config, **kwargs)
        self._record("built")

    def _record(self, event: str) -> None:
        if self.rank == 0:
            self.files.record_event(event, step=self.step, **self.identity)

    def _due(self, kind: str, step: int) -> Fault | None:
        """This rank's fault of ``kind`` due at ``step`` that has not fired yet (only rank 0 injects)."""
        if self.rank != 0:
            return None
        return next((fault for fault in self.faults if fault.kind == kind and fault.step <= step
                     and not self.files.has_fired(fault)), None)

    def resume(self) -> bool:
        resumed = super().resume()
        self._record("resumed")
        return resumed

    def train_step(self) -> dict[str, float]:
        fault = self._due("nan", self.step + 1)
        if fault is None:
            return super().train_step()
        self.files.mark_fired(fault, self.step + 1)
        handle = _first_embedding(self.model.parts).register_forward_hook(lambda module, inputs, output: output * float("nan"))
        try:
            return super().train_step()
        finally:
            handle.remove()

    def save(self) -> None:
        fault = self._due("disk_full", self.step)
        if fault is None:
            return super().save()
        self.files.mark_fired(fault, self.step)
        with _full_disk():
            super().save()


def _first_embedding(parts: list[torch.nn.Module]) -> torch.nn.Module:
    for part in parts:
        for module in part.modules():
            if isinstance(module, torch.nn.Embedding):
                return module
    raise RuntimeError("chaos nan fault: this model has no torch.nn.Embedding to poison; leave nan out of --kinds")


class _FullDiskStream:
    """A file that takes :data:`BYTES_BEFORE_FULL` bytes, then fails every write as a full disk does."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.written = stream, 0

    def write(self, data: Any) -> int:
        room = BYTES_BEFORE_FULL - self.written
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self.stream.write(bytes(memoryview(data)[:room]))
        self.written += written
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def _full_disk() -> Iterator[None]:
    """Every checkpoint data file written by torch.distributed.checkpoint in this block hits a full disk."""
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield _FullDiskStream(stream) if "w" in mode else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = original
