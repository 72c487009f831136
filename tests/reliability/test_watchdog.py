"""The step watchdog: a step over its limit ends the job with exit 3, this rank's stacks and the silent ranks."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from xscale.train.watchdog import (
    AUTO_MINIMUM_S,
    BEAT_KEY,
    EXIT_HUNG,
    PROCESS_KEY,
    STEP_KEY,
    WARMUP_STEPS,
    StepWatchdog,
    _process_identity,
)


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


def test_the_automatic_limit_starts_at_the_first_step_limit_then_follows_the_median():
    watchdog = StepWatchdog(0.0, first_step_timeout_s=600.0)
    for _ in range(WARMUP_STEPS - 1):
        watchdog.durations.append(100.0)
    assert watchdog.limit() == 600.0  # armed from the first step
    watchdog.durations.append(100.0)
    assert watchdog.limit() == 1000.0
    watchdog.durations[:] = [0.01] * WARMUP_STEPS
    assert watchdog.limit() == AUTO_MINIMUM_S
    assert StepWatchdog(0.0).limit() is None  # first_step_timeout_s=0: unwatched until the median exists


def test_a_hang_in_the_first_step_fires(capfd):
    exited, codes = threading.Event(), []
    watchdog = StepWatchdog(0.0, first_step_timeout_s=0.3, beat_s=0.05,
                            exit=lambda code: (codes.append(code), exited.set()))
    with watchdog:
        watchdog.begin(1)
        assert exited.wait(timeout=10)
    assert codes == [EXIT_HUNG]
    assert "step 1 has run" in capfd.readouterr().err


def test_a_save_is_watched_with_its_own_limit_and_not_timed_as_a_step(capfd):
    exited, codes = threading.Event(), []
    watchdog = StepWatchdog(0.0, first_step_timeout_s=0.3, beat_s=0.05,
                            exit=lambda code: (codes.append(code), exited.set()))
    watchdog.durations[:] = [0.01] * WARMUP_STEPS  # the step limit is now the auto minimum, 60 s
    with watchdog:
        with watchdog.watching(4, "checkpoint save"):
            assert watchdog.limit() == AUTO_MINIMUM_S  # the longer of the two
            watchdog.first_step_timeout_s = 0.3
            watchdog.timeout_s = 0.2
            assert exited.wait(timeout=10)
    assert watchdog.durations == [0.01] * WARMUP_STEPS
    assert "the checkpoint save after step 4 has run" in capfd.readouterr().err


def test_silent_ranks_on_this_host_are_killed_and_others_spared():
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        store = dist.HashStore()
        now = time.time()
        for rank, (process, beat) in enumerate([(stopped, now - 30), (alive, now)], start=1):
            store.set(BEAT_KEY.format(rank=rank), repr(beat))
            store.set(PROCESS_KEY.format(rank=rank), _process_identity(process.pid))
        store.set(BEAT_KEY.format(rank=3), repr(now - 30))  # a silent rank whose pid was reused since
        store.set(PROCESS_KEY.format(rank=3), f"{socket.gethostname()} {alive.pid} 1")
        watchdog = StepWatchdog(1.0, rank=0, world_size=4, store=store)
        assert watchdog.kill_silent_local_ranks() == [stopped.pid]
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert alive.poll() is None
    finally:
        for process in (stopped, alive):
            process.kill()
            process.wait()


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
