"""Save-and-requeue on preemption: a signal (or Slurm's stop file) sets a flag every rank agrees on.

Slurm delivers ``--signal=B:USR1@N`` to the batch shell N seconds before the time limit; the job script
(``xscale submit``) traps it and creates ``$XSCALE_STOP_FILE`` on the head node. Trainer processes started
any other way may get SIGUSR1/SIGTERM directly. Either way ``should_stop()`` turns true on every rank at the
same step (an all_reduce MAX), the trainer writes a checkpoint, rank 0 requeues the job and all ranks exit 0;
the requeued job resumes from the ``latest`` checkpoint.

With SIGINT among its signals (the trainer's), Ctrl-C is an interruption: every rank agrees on it the same way
(:attr:`PreemptionHandler.interrupted`), and the trainer saves and exits 130 instead of requeueing. A second Ctrl-C,
more than :data:`SECOND_INTERRUPT_S` after the first (torchrun forwards the terminal's SIGINT to its workers, which
got it from the terminal already), raises KeyboardInterrupt at once: stop without saving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

STOP_FILE_VARIABLE = "XSCALE_STOP_FILE"
REQUEUE_FILE_VARIABLE = "XSCALE_REQUEUE_FILE"
SECOND_INTERRUPT_S = 1.0
INTERRUPT, STOP = 2, 1  # the vote's values: an interruption outranks a preemption


class PreemptionHandler:
    """Install with ``install()`` (or ``with PreemptionHandler() as handler:``); poll ``should_stop()`` per step."""

    def __init__(
        self,
        signals: Sequence[signal.Signals] = (signal.SIGUSR1, signal.SIGTERM),
        stop_file: str | os.PathLike[str] | None = None,
        group: Any = None,
    ) -> None:
        self.signals = tuple(signals)
        stop_file = stop_file if stop_file is not None else os.environ.get(STOP_FILE_VARIABLE)
        self.stop_file = Path(stop_file) if stop_file else None
        self.group = group
        self.received: signal.Signals | None = None
        self.interrupted_at: float | None = None  # when this rank first got SIGINT
        self.interrupted = False  # some rank got SIGINT (set by should_stop, on every rank alike)
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run in the main thread (Python delivers signals there)")
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted_at is not None and now - self.interrupted_at > SECOND_INTERRUPT_S:
                raise KeyboardInterrupt
            self.interrupted_at = self.interrupted_at or now
        self.received = signal.Signals(signum)

    @property
    def requested_locally(self) -> bool:
        """This rank saw a signal or the stop file (no communication)."""
        return self.received is not None or (self.stop_file is not None and self.stop_file.exists())

    def should_stop(self) -> bool:
        """True on every rank as soon as any rank was asked to stop (collective: call it on all ranks)."""
        import torch
        import torch.distributed as dist

        vote = INTERRUPT if self.interrupted_at is not None else STOP if self.requested_locally else 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            flag = torch.tensor([vote], dtype=torch.int32, device=_collective_device(self.group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            vote = int(flag.item())
        self.interrupted = vote == INTERRUPT
        return vote > 0

    def requeue(self) -> bool:
        """Wait for every rank (the checkpoint is complete), then rank 0 asks Slurm to requeue this job.

        Under an ``xscale submit`` job script (``$XSCALE_REQUEUE_FILE`` set) rank 0 only leaves that file and
        the batch shell runs ``scontrol requeue`` once every rank has exited, so no rank is killed mid-exit;
        elsewhere rank 0 runs ``scontrol requeue`` itself. Returns True when the requeue was requested; False
        on other ranks and outside a Slurm job. Slurm then starts the job again with the same id and
        ``SLURM_RESTART_COUNT`` + 1.
        """
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier(group=self.group)
        if distributed and dist.get_rank() != 0:
            return False
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            print("xscale: preempted outside a Slurm job; start the run again to resume from the latest checkpoint",
                  flush=True)
            return False
        requeue_file = os.environ.get(REQUEUE_FILE_VARIABLE)
        if requeue_file:
            Path(requeue_file).touch()
            print(f"xscale: asked the job script to requeue Slurm job {job_id} once all ranks exit", flush=True)
            return True
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"xscale: scontrol requeue {job_id} failed: {result.stderr.strip()}", flush=True)
            return False
        print(f"xscale: requeued Slurm job {job_id}; it resumes from the latest checkpoint", flush=True)
        return True


def _collective_device(group: Any) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()
