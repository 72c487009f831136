"""The step watchdog: a step over its limit ends the job with exit 3, this rank's stacks and the silent ranks."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from xscale.train.watchdog import AUTO_MINIMUM_S, BEAT_KEY, EXIT_HUNG, STEP_KEY, WARMUP_STEPS, StepWatchdog


def test_a_step_over_its_limit_exits_with_the_stacks(capfd):
    exited = threading.Event()
    codes = []
    watchdog = StepWatchdog(0.3, beat_s=0.05, exit=lambda code: (codes.append(code), exited.set()))
    with watchdog:
        watchdog.begin(7)
        assert exited.wait(timeout=10)
    err = capfd.readouterr().err
    assert codes == [EXIT_HUNG]
    assert "step 7 has run" in err and "train.step_timeout_s=0.3" in err
    assert "test_a_step_over_its_limit_exits_with_the_stacks" in err  # the main thread's stack, where it waits


def test_steps_within_the_limit_never_fire():
    watchdog = StepWatchdog(0.5, beat_s=0.02, exit=lambda code: pytest.fail("fired"))
    with watchdog:
        for step in range(1, 6):
            watchdog.begin(step)
            time.sleep(0.05)
            watchdog.end()
        time.sleep(0.7)  # between steps nothing is timed


def test_the_automatic_limit_waits_for_warm_up_then_follows_the_median():
    watchdog = StepWatchdog(0.0)
    for _ in range(WARMUP_STEPS - 1):
        watchdog.durations.append(100.0)
    assert watchdog.limit() is None
    watchdog.durations.append(100.0)
    assert watchdog.limit() == 1000.0
    watchdog.durations[:] = [0.01] * WARMUP_STEPS
    assert watchdog.limit() == AUTO_MINIMUM_S


def test_the_report_names_a_silent_rank_and_one_behind():
    store = dist.HashStore()
    now = time.time()
    for rank, (beat, step) in enumerate([(now, 5), (now - 30, 5), (now, 4)]):
        store.set(BEAT_KEY.format(rank=rank), repr(beat))
        store.set(STEP_KEY.format(rank=rank), str(step))
    watchdog = StepWatchdog(1.0, rank=0, world_size=4, store=store)
    watchdog.current = (5, time.monotonic())
    report = watchdog.peers()
    assert "rank 1: silent for 30 s" in report
    assert "rank 2: alive but still before step 5" in report
    assert "rank 3: never reported" in report
    assert "rank 0" not in report
