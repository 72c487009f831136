"""The soak's arithmetic on a made-up timeline: detection, restart (and its parts), recomputed steps, lost seconds,
goodput."""

import math

import pytest

from xscale.launcher.chaos.plan import Fault
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
    step_durations,
    table,
)


def _timeline():
    """Steps 1-6 one second apart (t=1..6), a worker killed at t=6.5 (checkpoint at step 4), noticed at t=7,
    a new worker process at t=8 that imported by t=10, built by t=11, resumed step 4 at t=12, and logged steps 5-8
    at t=13.5.. (each step 1 s on its own)."""
    records = [StepRecord(float(t), t, 1.0, 1.0 / t) for t in range(1, 7)]
    records += [StepRecord(13.5 + i, 5 + i, 1.0, 1.0 / (5 + i)) for i in range(4)]
    events = [{"event": "process", "time": 8.0}, {"event": "start", "time": 10.0}, {"event": "built", "time": 11.0},
              {"event": "resumed", "time": 12.0}]
    injection = Injection(Fault(0, "kill_worker", 6, 1), time=6.5, step=6)
    return injection, records, [Signal(7.0, "exitcode: -9"), Signal(1.0, "before the fault")], events


def test_a_fault_is_measured_from_its_injection_to_the_first_resumed_step():
    injection, records, signals, events = _timeline()
    figures = fault_figures(injection, records, signals, events)
    assert figures.recovered and figures.detected_by == "exitcode: -9"
    assert figures.detection_s == pytest.approx(0.5)
    assert figures.restart_s == pytest.approx(12.5 - 7.0)  # the first resumed step began at 13.5 - 1 s
    assert figures.resumed_from == 4 and figures.steps_recomputed == 2
    assert figures.recompute_s == pytest.approx(2.0)  # steps 5 and 6 had taken 1 s each
    assert figures.lost_s == pytest.approx((12.5 - 6.0) + 2.0)
    assert figures.parts == pytest.approx({"spawn": 1.0, "imports": 2.0, "build": 1.0, "load": 1.0,
                                           "first_step": 0.5})
    assert sum(figures.parts.values()) == pytest.approx(figures.restart_s)


def test_a_fault_never_noticed_or_never_resumed_is_not_recovered():
    injection, records, signals, events = _timeline()
    assert not fault_figures(injection, records, [Signal(1.0, "before")], events).recovered
    unresumed = fault_figures(injection, records[:6], signals, events)
    assert not unresumed.recovered and unresumed.detection_s == pytest.approx(0.5)
    assert "NOT RECOVERED" in table([unresumed])
    assert "NOT RECOVERED" in table([FaultFigures(**row) for row in as_json([unresumed])])  # as read from --out


def test_goodput_counts_each_step_once_over_the_wall_time():
    _, records, _, _ = _timeline()
    counted = counted_records(records)
    assert sorted(counted) == list(range(1, 9)) and counted[5].time == 13.5  # the recomputed run of step 5 counts
    assert goodput(records, wall_s=20.0) == pytest.approx(8 / 20)
    assert math.isnan(goodput(records, wall_s=0.0))


def test_durations_span_saves_within_a_run_but_not_across_a_restart():
    _, records, _, events = _timeline()
    durations = step_durations(records, [event["time"] for event in events if event["event"] == "resumed"])
    assert durations[1:6] == [1.0] * 5 and durations[6] == 1.0  # step 5 after the restart: its own time
    assert median_lost([]) != median_lost([])  # NaN with nothing recovered
