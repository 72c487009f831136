"""Time on dedicated cores, on a shared machine: wall time minus the time the calling thread waited for a core.

Linux's ``/proc/thread-self/schedstat`` gives a thread's seconds on a CPU and seconds runnable but waiting on a run
queue (another process held the core). On a machine shared with other jobs, or with more processes than cores,
``wall - waited`` is what the work would take with a core of its own; time blocked on I/O or on a peer (a
collective's wait) is not run-queue time and stays in. Where the file is missing (not Linux) nothing is subtracted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SCHEDSTAT = "/proc/thread-self/schedstat"


def core_wait_seconds() -> float:
    """Seconds this thread has waited on a run queue since it started (0 where the kernel does not say)."""
    try:
        with open(SCHEDSTAT) as schedstat:
            return int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def dedicated_seconds(action: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, wall seconds less the run-queue wait) of one call of ``action``."""
    waited, start = core_wait_seconds(), time.perf_counter()
    action()
    wall = time.perf_counter() - start
    return wall, max(wall - (core_wait_seconds() - waited), 0.0)
