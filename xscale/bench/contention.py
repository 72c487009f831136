"""Time on dedicated cores, on a shared machine: wall time minus the time the calling thread waited for a core.

Linux's ``/proc/thread-self/schedstat`` gives a thread's seconds on a CPU and seconds runnable but waiting on a run
queue (another process held the core). On a machine shared with other jobs, or with more processes than cores,
``wall - waited`` is what the work would take with a core of its own; time blocked on I/O or on a peer (a
collective's wait) is not run-queue time and stays in. Where the file is missing (not Linux) nothing is subtracted.

With as many processes as cores or more (a layout that fills the machine), a thread's run-queue wait is mostly its
siblings' turn, which the step really pays. There the machine's accounting separates them
(:func:`uncontended_seconds`): over a step of wall time W on C cores, the machine was idle I core-seconds
(``/proc/stat``: idle + iowait) and the run's processes used P (their CPU time, every thread); the rest,
F = C W - I - P, went to other jobs (and the hypervisor's steal), and without them the step would take W - F / C.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SCHEDSTAT = "/proc/thread-self/schedstat"
PROC_STAT = "/proc/stat"
IDLE_FIELDS = (3, 4)  # idle, iowait in the "cpu" line's fields after its name


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


def machine_idle_seconds() -> float:
    """Core-seconds all cores have been idle since boot (``/proc/stat``'s idle + iowait); 0 where it does not say."""
    try:
        with open(PROC_STAT) as stat:
            fields = stat.readline().split()[1:]
        return sum(int(fields[index]) for index in IDLE_FIELDS) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def uncontended_seconds(wall: float, idle: float, run_cpu: float, cores: int) -> float:
    """W - F / C with F = C W - I - P the other jobs' core-seconds (module docstring), between P / C and W."""
    others = max(0.0, cores * wall - idle - run_cpu)
    return min(wall, max(run_cpu / cores, wall - others / cores))
