"""Time on dedicated cores (:mod:`xscale.bench.contention`): never above the wall time, never below the thread's
own time on a CPU."""

import sys
import time

import pytest

from xscale.bench.contention import dedicated_seconds, machine_idle_seconds, uncontended_seconds


def test_dedicated_time_is_between_cpu_and_wall_time():
    def spin() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    wall, dedicated = dedicated_seconds(spin)
    assert 0.02 <= wall and 0 < dedicated <= wall
    wall, dedicated = dedicated_seconds(lambda: time.sleep(0.02))  # blocked, not waiting for a core: kept
    assert 0.019 <= dedicated <= wall


def test_uncontended_time_takes_the_other_jobs_core_seconds_off():
    # 2 cores, a 1.0 s step: idle 0.1 core-s, the run's processes 1.5 core-s -> others 0.4 core-s -> 1.0 - 0.2
    assert uncontended_seconds(1.0, 0.1, 1.5, 2) == pytest.approx(0.8)
    assert uncontended_seconds(1.0, 0.5, 1.5, 2) == 1.0  # no other job: the wall time
    # never below the run's own CPU time over the cores, never above the wall time
    assert uncontended_seconds(1.0, 0.0, 0.2, 2) == pytest.approx(0.1)
    assert uncontended_seconds(1.0, 1.0, 1.5, 2) == 1.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_machine_idle_seconds_grow_while_sleeping():
    before = machine_idle_seconds()
    time.sleep(0.05)
    assert machine_idle_seconds() >= before > 0
