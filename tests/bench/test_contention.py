"""Time on dedicated cores (:mod:`xscale.bench.contention`): never above the wall time, never below the thread's
own time on a CPU."""

import time

from xscale.bench.contention import dedicated_seconds


def test_dedicated_time_is_between_cpu_and_wall_time():
    def spin() -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    wall, dedicated = dedicated_seconds(spin)
    assert 0.02 <= wall and 0 < dedicated <= wall
    wall, dedicated = dedicated_seconds(lambda: time.sleep(0.02))  # blocked, not waiting for a core: kept
    assert 0.019 <= dedicated <= wall
