"""Run a training job under torchrun ``--max-restarts`` and inject the schedule's faults, then a fault-free run of
the same config, and compare them.

The soak starts ``python -m torch.distributed.run ... -m xscale train`` with ``$XSCALE_CHAOS_PLAN`` set, reads the
run's ``metrics.jsonl`` as it grows (stamping each step with the time it appeared) and the job's output (stamping
the lines that show a fault was noticed), and injects each outside fault once the run has logged its step and
recovered from the previous one. A job that ends before the last step (the agent killed, a preemption, restarts
used up) is started again, as a Slurm requeue would; a newest checkpoint found damaged is moved aside by the job
itself (``checkpoint.resume=auto`` falls back to the newest one that verifies).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.launcher.chaos.plan import (
    IN_WORKER,
    JOB_VARIABLE,
    PLAN_VARIABLE,
    ChaosFiles,
    Fault,
    PlanError,
    default_kinds,
    draw_schedule,
    fault_gap,
    steps_needed,
)
from xscale.launcher.chaos.report import (
    FaultFigures,
    Injection,
    Signal,
    StepRecord,
    as_json,
    counted_records,
    fault_figures,
    goodput,
    median_lost,
    median_parts,
)
from xscale.runtime.processes import process_alive

POLL_S = 0.02
# Output that shows the job noticed a fault: xscale's own lines (watchdog, a refused step or save, a stop) and
# torchrun's about failed or signalled workers.
NOTICED = re.compile(r"xscale watchdog|xscale train:|xscale torchrun:|stop requested|exitcode|SignalException|Received Signals"
                     r"|Connection closed by peer|Connection reset|ProcessGroupGloo|[Tt]raceback")
WARM_MODULES = ["torch", "xscale.commands.train"]  # what a warm start imports once: the training command's stack
UNPLANNED_FAILURES = 3  # job failures no fault explains before the soak gives up


@dataclass
class SoakOptions:
    output_dir: Path
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    faults: int = 20
    seed: int = 0
    kinds: list[str] | None = None
    nproc: int = 2
    steps: int | None = None  # None: the fewest the schedule needs
    checkpoint_every: int = 5
    memory_every: int = 0  # checkpoint.memory_every of the job (0: disk checkpoints only)
    step_timeout_s: float = 5.0
    max_restarts: int = 3
    timeout_s: float = 3600.0
    reference: bool = True
    warm: list[str] | None = None  # modules a forkserver imports once (xscale.launcher.torchrun --warm); None: cold


@dataclass
class RunTimeline:
    """What one run (the soak or the fault-free reference) did, in wall-clock times."""

    records: list[StepRecord] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    jobs: int = 0
    began: float = 0.0
    ended: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)


class Job:
    """One start of torchrun; a thread reads its output, writes it to ``log`` and stamps the lines that matter."""

    def __init__(self, command: list[str], environ: dict[str, str], log: Path, timeline: RunTimeline) -> None:
        self.output: list[str] = []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=environ, start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(log, timeline), daemon=True)
        self._reader.start()

    def _read(self, log: Path, timeline: RunTimeline) -> None:
        assert self.process.stdout is not None
        with open(log, "a") as handle:
            for line in self.process.stdout:
                handle.write(line)
                self.output.append(line)
                if NOTICED.search(line):
                    timeline.signals.append(Signal(time.time(), line.strip()))

    def finish(self) -> int:
        code = self.process.wait()
        self._reader.join(timeout=10)
        return code

    def text(self) -> str:
        return "".join(self.output)


class JsonlTail:
    """The new lines of a growing JSON-lines file, each with the time it was read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def read(self) -> list[tuple[float, dict[str, Any]]]:
        if not self.path.exists():
            return []
        with open(self.path) as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        now, lines = time.time(), (self.partial + text).split("\n")
        self.partial = lines.pop()
        return [(now, json.loads(line)) for line in lines if line.strip()]


def step_record(read_at: float, record: dict[str, Any]) -> StepRecord:
    return StepRecord(read_at, int(record["step"]), float(record.get("perf/step_seconds", math.nan)),
                      float(record.get("train/loss", math.nan)))


class Soak:
    """One soak: the faulted run in ``<output_dir>/run``, the reference in ``<output_dir>/reference``."""

    def __init__(self, options: SoakOptions) -> None:
        self.options = options
        kinds = options.kinds or default_kinds(options.nproc)
        self.schedule = draw_schedule(options.faults, kinds, options.nproc, options.checkpoint_every, options.seed)
        needed = steps_needed(self.schedule, options.checkpoint_every)
        if options.steps is not None and options.steps < needed:
            raise PlanError(f"--steps {options.steps} is too few for {options.faults} faults {fault_gap(options.checkpoint_every)}+ "
                            f"steps apart: it needs at least {needed} (or leave --steps out)")
        self.steps = options.steps or needed

    # ------------------------------------------------------------------ the jobs
    def command(self, run_dir: Path, resume: str | None) -> list[str]:
        o = self.options
        overrides = [*o.overrides, f"train.steps={self.steps}", f"train.output_dir={run_dir}",
                     f"checkpoint.every={o.checkpoint_every}", f"checkpoint.memory_every={o.memory_every}",
                     "checkpoint.keep=2",
                     f"train.step_timeout_s={o.step_timeout_s:g}", "train.watchdog=true",
                     f"parallel.timeout_s={max(30, int(6 * o.step_timeout_s))}", "train.progress=false",
                     "train.plot=false"]
        if resume:
            overrides.append(f"checkpoint.resume={resume}")
        launcher = ["xscale.launcher.torchrun", f"--warm={','.join(o.warm)}"] if o.warm else ["torch.distributed.run"]
        return [sys.executable, "-m", *launcher, "--standalone", f"--nproc-per-node={o.nproc}",
                f"--max-restarts={o.max_restarts}", "--monitor-interval=0.1", "-m", "xscale", "train",
                *([o.config] if o.config else []), *overrides]

    def start(self, files: ChaosFiles, run_dir: Path, timeline: RunTimeline, resume: str | None = None) -> Job:
        environ = {**os.environ, PLAN_VARIABLE: str(files.plan), JOB_VARIABLE: str(timeline.jobs),
                   "PYTHONUNBUFFERED": "1"}
        environ.setdefault("OMP_NUM_THREADS", "1")
        timeline.jobs += 1
        return Job(self.command(run_dir, resume), environ, files.directory / "job.log", timeline)

    def run(self, name: str, schedule: list[Fault]) -> RunTimeline:
        """Train to the last step in ``<output_dir>/<name>`` while injecting ``schedule``; restart as needed."""
        run_dir = self.options.output_dir / name
        files = ChaosFiles(run_dir / "chaos")
        files.write_plan(schedule)
        timeline = RunTimeline(began=time.time())
        metrics, events = JsonlTail(run_dir / "metrics.jsonl"), JsonlTail(files.events)
        pending, unplanned, deadline = list(schedule), 0, time.time() + self.options.timeout_s
        job, truncate = self.start(files, run_dir, timeline), False

        def read() -> None:
            timeline.records.extend(step_record(at, record) for at, record in metrics.read())
            timeline.events.extend(event for _, event in events.read())
            self._note_fired(files, pending, timeline)

        try:
            while True:
                read()
                if job.process.poll() is not None:
                    code = job.finish()
                    timeline.exit_codes.append(code)
                    timeline.signals.append(Signal(time.time(), f"job exited with {code}"))
                    read()
                    counted = counted_records(timeline.records)
                    if code == 0 and counted and max(counted) >= self.steps:
                        break
                    explained = truncate or (timeline.injections and not self._recovered(timeline))
                    unplanned += 0 if explained or code == 0 else 1
                    if unplanned > UNPLANNED_FAILURES:
                        raise RuntimeError(f"the job failed {unplanned} times with no fault to explain it; see "
                                           f"{files.directory / 'job.log'}")
                    self._wait_for_workers(files)
                    if truncate:
                        timeline.rollbacks.append(f"cut {truncate_newest(run_dir / 'checkpoints')} in half")
                        truncate = False
                    job = self.start(files, run_dir, timeline)
                elif pending and pending[0].kind not in IN_WORKER and self._due(pending[0], timeline):
                    fault = pending.pop(0)
                    timeline.injections.append(self._inject(fault, files, job, timeline))
                    truncate = truncate or fault.kind == "truncate_checkpoint"
                if time.time() > deadline:
                    raise TimeoutError(f"the soak ran past its {self.options.timeout_s:g} s limit; see "
                                       f"{files.directory / 'job.log'}")
                time.sleep(POLL_S)
        finally:
            if job.process.poll() is None:
                self._kill(job, files)
            self._wait_for_workers(files)
        timeline.ended = time.time()
        timeline.injections.sort(key=lambda injection: injection.time)
        return timeline

    def _note_fired(self, files: ChaosFiles, pending: list[Fault], timeline: RunTimeline) -> None:
        """In-worker faults the workers fired since the last look."""
        for fault in [f for f in pending if f.kind in IN_WORKER]:
            fired = files.fired_at(fault)
            if fired is not None:
                pending.remove(fault)
                timeline.injections.append(Injection(fault, fired["time"], int(fired["step"]) - 1))

    @staticmethod
    def _recovered(timeline: RunTimeline) -> bool:
        """The run resumed after the last fault and logged a step since."""
        injected = max(injection.time for injection in timeline.injections)
        resumed = [event["time"] for event in timeline.events if event["event"] == "resumed" and event["time"] > injected]
        return bool(resumed) and any(record.time > resumed[0] for record in timeline.records)

    def _due(self, fault: Fault, timeline: RunTimeline) -> bool:
        if timeline.injections and not self._recovered(timeline):
            return False
        return bool(timeline.records) and timeline.records[-1].step >= fault.step

    def _inject(self, fault: Fault, files: ChaosFiles, job: Job, timeline: RunTimeline) -> Injection:
        step = timeline.records[-1].step
        workers = worker_pids(files, self.options.nproc)
        if fault.kind == "kill_worker":
            _signal(workers.get(fault.rank), signal.SIGKILL)
        elif fault.kind == "stop_worker":
            _signal(workers.get(fault.rank), signal.SIGSTOP)
        elif fault.kind in ("kill_agent", "truncate_checkpoint"):
            _signal(job.process.pid, signal.SIGKILL)
        elif fault.kind == "preempt":
            for pid in [job.process.pid, *workers.values()]:
                _signal(pid, signal.SIGTERM)
        now = time.time()
        files.mark_fired(fault, step + 1, now)
        return Injection(fault, now, step)

    def _kill(self, job: Job, files: ChaosFiles) -> None:
        for pid in [job.process.pid, *worker_pids(files, self.options.nproc).values()]:
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)
        job.finish()

    def _wait_for_workers(self, files: ChaosFiles, timeout_s: float = 60.0) -> None:
        """The last start's workers are gone (a killed agent's workers follow it; a stopped one is killed)."""
        deadline = time.time() + timeout_s
        for pid in worker_pids(files, self.options.nproc).values():
            while process_alive(pid) and time.time() < deadline:
                time.sleep(POLL_S)
            if process_alive(pid):
                _signal(pid, signal.SIGCONT)
                _signal(pid, signal.SIGKILL)


def worker_pids(files: ChaosFiles, nproc: int) -> dict[int, int]:
    pids = {}
    for rank in range(nproc):
        try:
            pids[rank] = int(json.loads(files.pid(rank).read_text())["pid"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
    return pids


def _signal(pid: int | None, signum: signal.Signals) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def truncate_newest(checkpoints: Path) -> str:
    """Cut the largest file of the checkpoint ``latest`` names to half its size; returns its path."""
    newest = checkpoints / (checkpoints / "latest").read_text().strip()
    largest = max((p for p in newest.rglob("*") if p.is_file() and p.name != "meta.json"), key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    os.truncate(largest, size // 2)
    return str(largest)


# ---------------------------------------------------------------------- the comparison and the summary


def final_checkpoint(run_dir: Path) -> tuple[int, dict[str, str]]:
    """The last checkpoint's step and the SHA-256 of its tensor files (model and optimizer shards), verified."""
    latest = Checkpointer(run_dir / "checkpoints").latest()
    if latest is None:
        raise RuntimeError(f"{run_dir} has no checkpoint: the run never finished a save")
    meta = Checkpointer.read_meta(latest, verify="full")
    return int(meta["step"]), {name: digest for name, digest in meta["sha256"].items() if name.endswith(TENSOR_FILES)}


TENSOR_FILES = ".distcp"  # DCP's data files; .metadata and meta.json name paths and times, not the state


def compare_runs(chaos: RunTimeline, chaos_dir: Path, reference: RunTimeline, reference_dir: Path,
                 steps: int) -> dict[str, Any]:
    """Did the faulted run end where the fault-free one did, bit for bit, having trained every step once?"""
    chaos_step, chaos_digests = final_checkpoint(chaos_dir)
    reference_step, reference_digests = final_checkpoint(reference_dir)
    differing = sorted(name for name in set(chaos_digests) | set(reference_digests)
                       if chaos_digests.get(name) != reference_digests.get(name))
    counted, expected = counted_records(chaos.records), counted_records(reference.records)
    loss_mismatch = [step for step, record in expected.items()
                     if step not in counted or not _same_float(counted[step].loss, record.loss)]
    return {"final_step": chaos_step, "reference_final_step": reference_step,
            "bit_identical": chaos_step == reference_step and not differing and bool(chaos_digests),
            "differing_files": differing, "steps_missing": [s for s in range(1, steps + 1) if s not in counted],
            "loss_mismatch_steps": loss_mismatch}


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def summarize(soak: Soak, chaos: RunTimeline, figures: list[FaultFigures], reference: RunTimeline | None,
              comparison: dict[str, Any] | None) -> dict[str, Any]:
    wall = chaos.ended - chaos.began
    summary = {"faults": len(soak.schedule), "injected": len(chaos.injections),
               "recovered": sum(f.recovered for f in figures), "steps": soak.steps, "jobs_started": chaos.jobs,
               "wall_s": wall, "goodput": goodput(chaos.records, wall), "median_lost_s": median_lost(figures),
               "median_restart_parts_s": median_parts(figures), "interventions": chaos.rollbacks}
    if reference is not None:
        summary["reference_wall_s"] = reference.ended - reference.began
        summary["reference_goodput"] = goodput(reference.records, reference.ended - reference.began)
    if comparison is not None:
        summary.update(comparison)
    return {"options": {key: str(value) if isinstance(value, Path) else value
                        for key, value in vars(soak.options).items()},
            "schedule": [vars(fault) for fault in soak.schedule], "faults": as_json(figures), "summary": summary}


def run_soak(options: SoakOptions) -> dict[str, Any]:
    """The soak, then the fault-free reference (unless ``options.reference`` is false); the report as a dict."""
    soak = Soak(options)
    chaos = soak.run("run", soak.schedule)
    figures = [fault_figures(injection, chaos.records, chaos.signals, chaos.events) for injection in chaos.injections]
    reference = soak.run("reference", []) if options.reference else None
    comparison = (compare_runs(chaos, options.output_dir / "run", reference, options.output_dir / "reference",
                               soak.steps) if reference is not None else None)
    return summarize(soak, chaos, figures, reference, comparison)
