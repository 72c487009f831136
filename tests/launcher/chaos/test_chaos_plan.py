"""The chaos soak's schedule: seeded, every kind before any repeats, faults far enough apart to recover between."""

import pytest

from xscale.launcher.chaos.plan import (
    IN_WORKER,
    KINDS,
    ChaosFiles,
    PlanError,
    default_kinds,
    draw_schedule,
    fault_gap,
    first_fault_step,
    steps_needed,
)


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    kinds = default_kinds(2)
    assert draw_schedule(20, kinds, 2, 5, seed=3) == draw_schedule(20, kinds, 2, 5, seed=3)
    assert draw_schedule(20, kinds, 2, 5, seed=3) != draw_schedule(20, kinds, 2, 5, seed=4)


def test_every_kind_comes_before_any_comes_twice_and_faults_are_spaced():
    kinds = default_kinds(2)
    schedule = draw_schedule(3 * len(kinds), kinds, 2, checkpoint_every=5, seed=0)
    for cycle in range(3):
        assert sorted(f.kind for f in schedule[cycle * len(kinds):(cycle + 1) * len(kinds)]) == sorted(kinds)
    steps = [f.step for f in schedule]
    assert steps[0] >= first_fault_step(5)
    assert all(later - earlier >= fault_gap(5) for earlier, later in zip(steps, steps[1:]))
    assert all(f.rank == 0 for f in schedule if f.kind in IN_WORKER)
    assert {f.rank for f in schedule} <= {0, 1}
    assert steps_needed(schedule, 5) == steps[-1] + fault_gap(5)


def test_one_process_leaves_out_the_stopped_worker_and_refuses_it_by_name():
    assert "stop_worker" not in default_kinds(1) and set(default_kinds(2)) == set(KINDS)
    with pytest.raises(PlanError, match="stop_worker needs --nproc 2"):
        draw_schedule(3, ["stop_worker"], 1, 5, seed=0)
    with pytest.raises(PlanError, match="unknown fault kind kill_node"):
        draw_schedule(3, ["kill_node"], 2, 5, seed=0)


def test_the_plan_and_the_fired_markers_round_trip(tmp_path):
    files = ChaosFiles(tmp_path)
    schedule = draw_schedule(4, default_kinds(2), 2, 5, seed=1)
    files.write_plan(schedule)
    assert files.read_plan() == schedule
    assert not files.has_fired(schedule[1])
    files.mark_fired(schedule[1], step=17, when=123.5)
    assert files.has_fired(schedule[1]) and files.fired_at(schedule[1]) == {"time": 123.5, "step": 17}
    files.record_event("start", job=0)
    assert [event["event"] for event in files.read_events()] == ["start"]
