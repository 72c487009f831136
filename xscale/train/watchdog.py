"""A per-rank watchdog that ends a hung job in seconds, naming the rank that holds it, instead of after the process
group's timeout (30 min with gloo, 10 with nccl) with nothing said.

Each rank runs a thread that, every ``beat_s``, writes a liveness beat (and its host and pid) into the rendezvous
store, and the training loop marks where each step, checkpoint save and evaluation begins and ends. When one runs
past its limit, the thread prints which ranks stopped beating or are behind (a stopped, dead or deadlocked rank stops
beating; a rank that waits in a collective still beats), this rank's Python stacks (``faulthandler``: the collective
it waits in is on them), SIGKILLs the silent ranks on its own host (a SIGSTOPped rank ignores the launcher's SIGTERM,
which would cost torchrun's 30 s grace) and exits with :data:`EXIT_HUNG` so that torchrun, Slurm or the user's
requeue takes over. Every rank's watchdog fires the same way, so every live rank prints its own stacks.

Limits: a step's is ``train.step_timeout_s``, or with 0 (auto) ``first_step_timeout_s`` until ``WARMUP_STEPS`` steps
have run and then ten times their median, at least ``AUTO_MINIMUM_S``; a save's or an evaluation's is
``first_step_timeout_s`` (0: unwatched) or the step's, whichever is longer.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

EXIT_HUNG = 3
WARMUP_STEPS = 5
AUTO_FACTOR = 10.0
AUTO_MINIMUM_S = 60.0
BEAT_KEY = "xscale/watchdog/beat/{rank}"
STEP_KEY = "xscale/watchdog/step/{rank}"
PROCESS_KEY = "xscale/watchdog/process/{rank}"  # "host pid start-time": who to SIGKILL when it goes silent
STEP = "step"


class StepWatchdog:
    """Use as a context manager around the loop; call :meth:`begin` / :meth:`end` around each step."""

    def __init__(self, timeout_s: float, *, first_step_timeout_s: float = 0.0, rank: int = 0, world_size: int = 1,
                 store: Any = None, beat_s: float = 1.0, exit: Callable[[int], None] = os._exit) -> None:
        self.timeout_s = timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.rank, self.world_size = rank, world_size
        self.store = store
        self.beat_s = beat_s
        self.exit = exit
        self.durations: list[float] = []
        self.current: tuple[int, float] | None = None  # (step, monotonic start) of what runs now
        self.phase = STEP  # what runs now: a step, "checkpoint save" or "evaluation"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="xscale-watchdog", daemon=True)

    def __enter__(self) -> StepWatchdog:
        if self.store is not None:
            try:
                self.store.set(PROCESS_KEY.format(rank=self.rank), _process_identity(os.getpid()))
            except Exception:  # noqa: BLE001 - without it the silent ranks are only named, not killed
                pass
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.beat_s)

    def begin(self, step: int, phase: str = STEP) -> None:
        """``phase``: a training step (timed for the auto limit), or another watched span ("checkpoint save")."""
        self.phase = phase
        self.current = (step, time.monotonic())
        if self.store is not None and phase == STEP:
            self.store.set(STEP_KEY.format(rank=self.rank), str(step))

    def end(self) -> None:
        if self.current is not None and self.phase == STEP:
            self.durations.append(time.monotonic() - self.current[1])
            del self.durations[:-100]  # the median of the recent steps
        self.current = None

    @contextlib.contextmanager
    def watching(self, step: int, phase: str) -> Iterator[None]:
        """A span other than a step (a save, an evaluation) under its own limit."""
        self.begin(step, phase)
        try:
            yield
        finally:
            self.end()

    def limit(self) -> float | None:
        """Seconds the current phase may run (None: unwatched)."""
        step_limit = self._step_limit()
        if self.phase == STEP:
            return step_limit
        return max(step_limit or 0.0, self.first_step_timeout_s) or None

    def _step_limit(self) -> float | None:
        if self.timeout_s > 0:
            return self.timeout_s
        if len(self.durations) < WARMUP_STEPS:  # the first steps: a fixed floor until the median is known
            return self.first_step_timeout_s or None
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
                self.kill_silent_local_ranks()
                sys.stdout.flush()
                sys.stderr.flush()
                self.exit(EXIT_HUNG)
                return

    def _beat(self) -> None:
        if self.store is not None:
            try:
                self.store.set(BEAT_KEY.format(rank=self.rank), repr(time.time()))
            except Exception:  # the store's host may be gone; the step limit still applies
                pass

    def silent_ranks(self) -> list[int]:
        """Ranks whose beat stopped (stopped, dead or deadlocked)."""
        if self.store is None:
            return []
        now, silent = time.time(), []
        for rank in range(self.world_size):
            try:
                if not self.store.check([BEAT_KEY.format(rank=rank)]):  # get() would wait for it
                    continue
                beat = float(self.store.get(BEAT_KEY.format(rank=rank)).decode())
            except Exception:  # noqa: BLE001 - never reported or the store is gone: not known to be silent
                continue
            if now - beat > 2 * self.beat_s + 0.5:
                silent.append(rank)
        return silent

    def kill_silent_local_ranks(self) -> list[int]:
        """SIGKILL every silent rank on this host (checked by pid and start time, so a reused pid is spared):
        a SIGSTOPped rank would otherwise sit through torchrun's SIGTERM grace (30 s). Returns the pids killed."""
        killed = []
        for rank in self.silent_ranks():
            try:
                if not self.store.check([PROCESS_KEY.format(rank=rank)]):
                    continue
                identity = self.store.get(PROCESS_KEY.format(rank=rank)).decode()
                host, pid, _ = identity.split(" ", 2)
                if host == socket.gethostname() and int(pid) != os.getpid() and _process_identity(int(pid)) == identity:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
            except Exception:  # noqa: BLE001 - gone already, or not ours to kill
                continue
        return killed

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

    def _rule(self) -> str:
        if self.phase != STEP:
            return f"train.first_step_timeout_s={self.first_step_timeout_s:g} or the step's limit, the longer"
        if self.timeout_s > 0:
            return f"train.step_timeout_s={self.timeout_s:g}"
        if len(self.durations) < WARMUP_STEPS:
            return f"train.first_step_timeout_s={self.first_step_timeout_s:g} until {WARMUP_STEPS} steps have run"
        return f"auto: {AUTO_FACTOR:g}x the median step, at least {AUTO_MINIMUM_S:g} s"

    def _report(self, step: int, seconds: float, limit: float) -> None:
        peers = self.peers()
        what = f"step {step}" if self.phase == STEP else f"the {self.phase} after step {step}"
        print(f"xscale watchdog: rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): {what} has "
              f"run {seconds:.1f} s, over its limit of {limit:.1f} s ({self._rule()}); ending the job (exit "
              f"{EXIT_HUNG}) so that the launcher restarts it from the last checkpoint.\n"
              + (f"ranks holding the job:\n{peers}\n" if peers else "no other rank found silent or behind\n")
              + f"rank {self.rank}'s stacks (the collective it waits in is on them):", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()


def _process_identity(pid: int) -> str:
    """"host pid start-time" of a process (start time in clock ticks since boot, from /proc; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            started = handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    return f"{socket.gethostname()} {pid} {started}"
