"""A per-rank watchdog that ends a hung job in seconds, naming the rank that holds it, instead of after the process
group's timeout (30 min with gloo, 10 with nccl) with nothing said.

Each rank runs a thread that, every ``beat_s``, writes a liveness beat into the rendezvous store, and the training
loop marks where each step begins and ends. When a step runs past its limit (``train.step_timeout_s``, or with 0
ten times the median of the steps so far, at least ``AUTO_MINIMUM_S``, once ``WARMUP_STEPS`` have run), the thread
prints which ranks stopped beating or are behind (a stopped, dead or deadlocked rank stops beating; a rank that
waits in a collective still beats), this rank's Python stacks (``faulthandler``: the collective it waits in is on
them), and exits with :data:`EXIT_HUNG` so that torchrun, Slurm or the user's requeue takes over. Every rank's
watchdog fires the same way, so every live rank prints its own stacks.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EXIT_HUNG = 3
WARMUP_STEPS = 5
AUTO_FACTOR = 10.0
AUTO_MINIMUM_S = 60.0
BEAT_KEY = "xscale/watchdog/beat/{rank}"
STEP_KEY = "xscale/watchdog/step/{rank}"


class StepWatchdog:
    """Use as a context manager around the loop; call :meth:`begin` / :meth:`end` around each step."""

    def __init__(self, timeout_s: float, *, rank: int = 0, world_size: int = 1, store: Any = None,
                 beat_s: float = 1.0, exit: Callable[[int], None] = os._exit) -> None:
        self.timeout_s = timeout_s
        self.rank, self.world_size = rank, world_size
        self.store = store
        self.beat_s = beat_s
        self.exit = exit
        self.durations: list[float] = []
        self.current: tuple[int, float] | None = None  # (step, monotonic start) of the step running now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="xscale-watchdog", daemon=True)

    def __enter__(self) -> StepWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.beat_s)

    def begin(self, step: int) -> None:
        self.current = (step, time.monotonic())
        if self.store is not None:
            self.store.set(STEP_KEY.format(rank=self.rank), str(step))

    def end(self) -> None:
        if self.current is not None:
            self.durations.append(time.monotonic() - self.current[1])
            del self.durations[:-100]  # the median of the recent steps
        self.current = None

    def limit(self) -> float | None:
        """Seconds a step may run (None: no limit yet, during the auto mode's warm-up)."""
        if self.timeout_s > 0:
            return self.timeout_s
        if len(self.durations) < WARMUP_STEPS:
            return None
        return max(AUTO_FACTOR * statistics.median(self.durations), AUTO_MINIMUM_S)

    # ------------------------------------------------------------------ the thread
    def _watch(self) -> None:
        self._beat()
        while not self._stop.wait(self.beat_s):
            self._beat()
            current, limit = self.current, self.limit()
            if current is None or limit is None:
                continue
            step, started = current
            if time.monotonic() - started > limit:
                self._report(step, time.monotonic() - started, limit)
                self.exit(EXIT_HUNG)
                return

    def _beat(self) -> None:
        if self.store is not None:
            try:
                self.store.set(BEAT_KEY.format(rank=self.rank), repr(time.time()))
            except Exception:  # the store's host may be gone; the step limit still applies
                pass

    def peers(self) -> str:
        """One line per rank that stopped beating or has not begun this rank's step (empty: none found)."""
        if self.store is None:
            return ""
        now, step = time.time(), self.current[0] if self.current else -1
        lines = []
        for rank in range(self.world_size):
            try:
                beat_keys = [BEAT_KEY.format(rank=rank), STEP_KEY.format(rank=rank)]
                if not self.store.check(beat_keys):
                    lines.append(f"  rank {rank}: never reported")
                    continue
                silent = now - float(self.store.get(beat_keys[0]).decode())
                began = int(self.store.get(beat_keys[1]).decode())
            except Exception as error:  # noqa: BLE001 - a report must not fail
                lines.append(f"  rank {rank}: unknown ({type(error).__name__})")
                continue
            if silent > 2 * self.beat_s + 0.5:
                lines.append(f"  rank {rank}: silent for {silent:.0f} s (stopped, dead or deadlocked), last began "
                             f"step {began}")
            elif began < step:
                lines.append(f"  rank {rank}: alive but still before step {step} (last began step {began})")
        return "\n".join(lines)

    def _report(self, step: int, seconds: float, limit: float) -> None:
        rule = (f"train.step_timeout_s={self.timeout_s:g}" if self.timeout_s > 0 else
                f"auto: {AUTO_FACTOR:g}x the median step, at least {AUTO_MINIMUM_S:g} s")
        peers = self.peers()
        print(f"xscale watchdog: rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): step {step} has "
              f"run {seconds:.1f} s, over its limit of {limit:.1f} s ({rule}); ending the job (exit {EXIT_HUNG}) so "
              "that the launcher restarts it from the last checkpoint.\n"
              + (f"ranks holding the job:\n{peers}\n" if peers else "no other rank found silent or behind\n")
              + f"rank {self.rank}'s stacks (the collective it waits in is on them):", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
