"""A chaos soak's schedule: which fault hits at which step and rank, drawn from a seed, and the files through which
the soak and the workers it starts talk (the plan, the workers' pids, the faults the workers fired, their events)."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PLAN_VARIABLE = "XSCALE_CHAOS_PLAN"  # the plan file a worker reads; unset: no fault injection at all
JOB_VARIABLE = "XSCALE_CHAOS_JOB"  # which start of the job (0, 1, ...) a worker belongs to

# What each kind does, and who injects it (the soak from outside, or the worker itself).
KINDS = {
    "kill_worker": "SIGKILL one worker (torchrun restarts the group)",
    "stop_worker": "SIGSTOP one worker (the peers' watchdog ends the job after train.step_timeout_s)",
    "kill_agent": "SIGKILL the torchrun agent (its workers die with it; the soak starts the job again, as a requeue)",
    "preempt": "SIGTERM to the agent and every worker (save at the next step, exit; the soak requeues)",
    "truncate_checkpoint": "SIGKILL the agent, cut the newest checkpoint's largest file in half, start again",
    "nan": "a NaN in the embedding's output at one step on rank 0 (the run stops without saving it)",
    "disk_full": "ENOSPC inside the checkpoint write of the first save at or after the step, on rank 0",
}
IN_WORKER = ("nan", "disk_full")
NEEDS_PEERS = ("stop_worker",)  # a stopped single process stops its own watchdog too: nobody would notice


class PlanError(ValueError):
    """The soak's options cannot make a schedule; the message says what to change."""


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    step: int  # injected once the run has logged this step (in-worker faults: at this step / the save after it)
    rank: int


def default_kinds(nproc: int) -> list[str]:
    return [kind for kind in KINDS if nproc > 1 or kind not in NEEDS_PEERS]


def check_kinds(kinds: list[str], nproc: int) -> None:
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise PlanError(f"unknown fault kind {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    if nproc < 2 and any(kind in NEEDS_PEERS for kind in kinds):
        raise PlanError("stop_worker needs --nproc 2 or more: a stopped single process stops its own watchdog")
    if not kinds:
        raise PlanError("--kinds is empty; name at least one of " + ", ".join(KINDS))


def fault_gap(checkpoint_every: int) -> int:
    """Fewest steps between two faults: the run gets back past the previous fault's recomputed steps first."""
    return checkpoint_every + 2


def first_fault_step(checkpoint_every: int) -> int:
    """Two checkpoints exist before the first fault, so a damaged newest one leaves an older one to resume."""
    return 2 * checkpoint_every + 1


def draw_schedule(faults: int, kinds: list[str], nproc: int, checkpoint_every: int, seed: int) -> list[Fault]:
    """``faults`` faults whose kinds cycle through ``kinds`` in a seeded order (every kind once before any twice),
    at increasing steps at least :func:`fault_gap` apart, each on a seeded rank (rank 0 for in-worker kinds)."""
    check_kinds(kinds, nproc)
    if faults < 0:
        raise PlanError(f"--faults {faults} is negative")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        cycle = list(kinds)
        rng.shuffle(cycle)
        order.extend(cycle)
    schedule, step = [], first_fault_step(checkpoint_every) - fault_gap(checkpoint_every)
    for index, kind in enumerate(order[:faults]):
        step += fault_gap(checkpoint_every) + rng.randrange(checkpoint_every + 1)
        rank = 0 if kind in IN_WORKER else rng.randrange(nproc)
        schedule.append(Fault(index, kind, step, rank))
    return schedule


def steps_needed(schedule: list[Fault], checkpoint_every: int) -> int:
    """Steps a run needs so that every fault hits and the run recovers from the last one."""
    return (schedule[-1].step if schedule else 0) + fault_gap(checkpoint_every)


# ---------------------------------------------------------------------- the files shared with the workers


@dataclass(frozen=True)
class ChaosFiles:
    """Everything the soak and its workers exchange, under one directory."""

    directory: Path

    @property
    def plan(self) -> Path:
        return self.directory / "plan.json"

    def pid(self, rank: int) -> Path:
        return self.directory / "pids" / f"rank_{rank}.json"

    def fired(self, fault: Fault) -> Path:
        return self.directory / "fired" / f"fault_{fault.index:03d}.json"

    @property
    def events(self) -> Path:
        return self.directory / "events.jsonl"

    def write_plan(self, schedule: list[Fault]) -> None:
        self.plan.parent.mkdir(parents=True, exist_ok=True)
        self.plan.write_text(json.dumps({"faults": [asdict(fault) for fault in schedule]}, indent=1))

    def read_plan(self) -> list[Fault]:
        return [Fault(**fault) for fault in json.loads(self.plan.read_text())["faults"]]

    def mark_fired(self, fault: Fault, step: int, when: float | None = None) -> None:
        """Record that ``fault`` was injected now (once: a restarted run passing the step again does not repeat it)."""
        write_json_atomic(self.fired(fault), {"time": time.time() if when is None else when, "step": step})

    def has_fired(self, fault: Fault) -> bool:
        return self.fired(fault).exists()

    def fired_at(self, fault: Fault) -> dict[str, Any] | None:
        try:
            return json.loads(self.fired(fault).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def record_event(self, event: str, **fields: Any) -> None:
        """Append one worker event (``start``, ``built``, ``resumed``) with the time it happened."""
        self.events.parent.mkdir(parents=True, exist_ok=True)
        with open(self.events, "a") as handle:
            handle.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]


def write_json_atomic(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` was created (Unix time to 10 ms, from Linux's /proc; None elsewhere)."""
    try:
        started_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
