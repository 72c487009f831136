"""Time on dedicated cores (:mod:`xscale.bench.contention`): never above the wall time, never below the thread's
own time on a CPU."""

import time

import pytest

from xscale.bench.contention import dedicated_seconds, uncontended_seconds


def test_dedicated_time_is_between_cpu_and_wall_time():
    def spin() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    wall, dedicated = dedicated_seconds(spin)
    assert 0.02 <= wall and 0 < dedicated <= wall
    wall, dedicated = dedicated_seconds(lambda: time.sleep(0.02))  # blocked, not waiting for a core: kept
    assert 0.019 <= dedicated <= wall



def test_uncontended_time_is_at_least_the_runs_cpu_time_over_the_cores():
    # 4 ranks on 2 cores used 1.0 core-s: at least 0.5 s whatever a rank's own run-queue waits say
    assert uncontended_seconds(1.2, 0.3, 1.0, 2) == pytest.approx(0.5)
    assert uncontended_seconds(1.2, 0.7, 1.0, 2) == pytest.approx(0.7)  # a rank blocked on its peers: its own time
    assert uncontended_seconds(0.4, 0.3, 1.0, 2) == pytest.approx(0.4)  # never above the wall time
