"""Time on dedicated cores, on a shared machine: wall time minus the time the calling thread waited for a core.

Linux's ``/proc/thread-self/schedstat`` gives a thread's seconds on a CPU and seconds runnable but waiting on a run
queue (another process held the core). On a machine shared with other jobs, or with more processes than cores,
``wall - waited`` is what the work would take with a core of its own; time blocked on I/O or on a peer (a
collective's wait) is not run-queue time and stays in. Where the file is missing (not Linux) nothing is subtracted.

With more processes than cores, a thread's run-queue wait is partly its siblings' turn, which the step really
pays: the run's processes used P core-seconds in the step (their CPU time, every thread), so on C cores it takes at
least P / C. :func:`uncontended_seconds` keeps the larger of the two lower bounds, the thread's time on dedicated
cores and P / C (never above the wall time). The machine's idle time (``/proc/stat``) cannot separate them on a
loaded machine: other jobs fill the cores a rank leaves idle in a pipeline bubble as well as those it waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SCHEDSTAT = "/proc/thread-self/schedstat"


def _schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of this thread so far; (0, 0) where the kernel does not
    say."""
    try:
        with open(SCHEDSTAT) as schedstat:
            on_cpu, waited = schedstat.read().split()[:2]
        return int(on_cpu) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def dedicated_seconds(action: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, wall seconds less the run-queue wait) of one call of ``action``; the second never below the
    thread's own seconds on a CPU in the call (the kernel books a wait at the next switch, which can fall on the
    other side of a short call)."""
    on_cpu, waited = _schedstat()
    start = time.perf_counter()
    action()
    wall = time.perf_counter() - start
    on_cpu_after, waited_after = _schedstat()
    return wall, min(wall, max(wall - (waited_after - waited), on_cpu_after - on_cpu))


def uncontended_seconds(wall: float, dedicated: float, run_cpu: float, cores: int) -> float:
    """max(time on dedicated cores, P / C), at most the wall time (module docstring)."""
    return min(wall, max(dedicated, run_cpu / cores))
