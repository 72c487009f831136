"""A soak's timeline turned into figures: per fault the detection time, restart time (split into its parts), steps
recomputed and seconds lost; for the run, its goodput (seconds of the steps that count / wall seconds).

A fault's lost time runs from the end of the last step logged before it was detected to the start of the first step
of the resumed run, plus the time the recomputed steps had taken before: all the wall time that produced nothing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from xscale.launcher.chaos.plan import Fault

RESTART_PARTS = ("spawn", "imports", "build", "load", "first_step")  # where a restart's time goes, in order
# The worker events that end each part (the first step's end is its metrics record); see xscale.train.fault_injection.
PART_ENDS = {"spawn": "process", "imports": "start", "build": "built", "load": "resumed"}


@dataclass(frozen=True)
class StepRecord:
    """A step's metrics record, stamped with the time the soak read it."""

    time: float
    step: int
    seconds: float  # perf/step_seconds: the step's own time
    loss: float


@dataclass(frozen=True)
class Injection:
    fault: Fault
    time: float
    step: int  # the last step logged when it was injected


@dataclass(frozen=True)
class Signal:
    """Something the job said or did that shows it noticed a fault: an error line, a restart, its exit."""

    time: float
    text: str


@dataclass
class FaultFigures:
    index: int
    kind: str
    step: int
    rank: int
    recovered: bool
    detected_by: str = ""
    detection_s: float = math.nan
    restart_s: float = math.nan
    steps_recomputed: int = 0
    recompute_s: float = 0.0
    lost_s: float = math.nan
    resumed_from: int = -1
    parts: dict[str, float] | None = None  # restart_s split as RESTART_PARTS (absent parts left out)


def step_durations(records: list[StepRecord], restarts: list[float]) -> list[float]:
    """Wall seconds of each record: from the previous record when that was the step before in the same run (saves
    and logging included), else the step's own time."""
    durations = []
    for index, record in enumerate(records):
        previous = records[index - 1] if index else None
        continued = (previous is not None and previous.step == record.step - 1
                     and not any(previous.time < restart < record.time for restart in restarts))
        durations.append(record.time - previous.time if continued else record.seconds)
    return durations


def fault_figures(injection: Injection, records: list[StepRecord], signals: list[Signal],
                  events: list[dict[str, Any]]) -> FaultFigures:
    """The figures of one fault from the whole timeline (records in the order they were read)."""
    fault = injection.fault
    figures = FaultFigures(fault.index, fault.kind, injection.step, fault.rank, recovered=False)
    detection = next((signal for signal in sorted(signals, key=lambda s: s.time) if signal.time >= injection.time), None)
    if detection is None:
        return figures
    figures.detected_by, figures.detection_s = detection.text, detection.time - injection.time
    resumed = next((event for event in sorted(events, key=lambda e: e["time"])
                    if event["event"] == "resumed" and event["time"] > detection.time), None)
    after = None if resumed is None else next((r for r in records if r.time > resumed["time"]), None)
    before = [r for r in records if r.time < detection.time]
    if after is None:
        return figures
    restart_at = after.time - after.seconds
    figures.recovered = True
    figures.restart_s = restart_at - detection.time
    figures.resumed_from = after.step - 1
    last = before[-1] if before else None
    restarts = [event["time"] for event in events if event["event"] == "resumed"]
    durations = step_durations(records, restarts)
    if last is not None:
        redone = {r.step: d for r, d in zip(records, durations) if r.time < detection.time and r.step > after.step - 1}
        figures.steps_recomputed = max(0, last.step - (after.step - 1))
        figures.recompute_s = sum(redone.values())
        figures.lost_s = restart_at - last.time + figures.recompute_s
    else:
        figures.lost_s = restart_at - injection.time
    figures.parts = restart_parts(detection.time, restart_at, events)
    return figures


def restart_parts(detected: float, restart_at: float, events: list[dict[str, Any]]) -> dict[str, float]:
    """The restart's time by part: each part ends at the last worker event of its kind in (detected, restart_at)."""
    ends = {}
    for part, event_name in PART_ENDS.items():
        times = [e["time"] for e in events if e["event"] == event_name and e.get("time") is not None
                 and detected < e["time"] <= restart_at]
        if times:
            ends[part] = max(times)
    ends["first_step"] = restart_at
    parts, previous = {}, detected
    for part in RESTART_PARTS:
        if part in ends:
            parts[part] = max(0.0, ends[part] - previous)
            previous = max(previous, ends[part])
    return parts


def counted_records(records: list[StepRecord]) -> dict[int, StepRecord]:
    """Step -> the record that counts: its last run (earlier runs of it were recomputed after a fault)."""
    counted: dict[int, StepRecord] = {}
    for record in records:
        counted[record.step] = record
    return dict(sorted(counted.items()))


def goodput(records: list[StepRecord], wall_s: float) -> float:
    """Seconds spent in the steps that count over the wall seconds of the whole run (1.0: nothing else)."""
    if wall_s <= 0:
        return math.nan
    return sum(record.seconds for record in counted_records(records).values()) / wall_s


def median_lost(figures: list[FaultFigures]) -> float:
    lost = [f.lost_s for f in figures if f.recovered and not math.isnan(f.lost_s)]
    return statistics.median(lost) if lost else math.nan


def median_parts(figures: list[FaultFigures]) -> dict[str, float]:
    """The median of each restart part over the faults that recovered."""
    return {part: statistics.median(values) for part in RESTART_PARTS
            if (values := [f.parts[part] for f in figures if f.parts and part in f.parts])}


def table(figures: list[FaultFigures]) -> str:
    """One row per fault, aligned for a terminal."""
    header = ("#", "fault", "step", "rank", "detect s", "restart s", "recomputed", "lost s", "detected by")
    rows = [header]
    for f in figures:
        rows.append((str(f.index), f.kind, str(f.step), str(f.rank), _seconds(f.detection_s), _seconds(f.restart_s),
                     str(f.steps_recomputed) if f.recovered else "-",
                     _seconds(f.lost_s) if f.recovered else "NOT RECOVERED", f.detected_by[:60]))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def as_json(figures: list[FaultFigures]) -> list[dict[str, Any]]:
    return [{key: (None if isinstance(value, float) and math.isnan(value) else value)
             for key, value in asdict(f).items()} for f in figures]
