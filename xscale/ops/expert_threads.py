"""Per-expert work spread over the CPU's threads: experts side by side, not threads inside each expert's GEMM.

E experts' GEMMs of a few hundred rows each, every one split over all intra-op threads, pay a team wake-up and a
load imbalance per GEMM; on 2 cores eight 512-row expert GEMMs ran 1.18-1.22x the time of the one 4096-row dense
GEMM of the same FLOPs. Giving each thread whole experts (the CPU analogue of a grouped GEMM's tiles over
experts) with one intra-op thread each brings them to 0.97-1.06x (``xscale bench moe``, experts only vs dense).

:func:`for_each_expert` runs ``work(expert, rows)`` for every expert with rows: one after another on accelerators,
with one thread, or with a single expert; otherwise in groups balanced by row count, the calling thread running the
first group and persistent worker threads the others, each with ``threads // groups`` intra-op threads
(``torch.set_num_threads(1)`` runs them one after another). ``work`` must
write only its own rows of preallocated outputs; it runs under ``torch.no_grad()`` with autocast off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

Work = Callable[[int, slice], None]


class _WorkerPools:
    """The process's worker pools by (workers, intra-op threads each), made on first use (like torch's own thread
    pools); a forked child has none of its parent's threads and starts with none."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
        self.lock = threading.Lock()

    def forget(self) -> None:
        self.pools = {}
        self.lock = threading.Lock()


_WORKERS = _WorkerPools()
os.register_at_fork(after_in_child=_WORKERS.forget)


def expert_rows(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, its rows) for every expert with rows, the rows sorted by expert."""
    rows, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            rows.append((expert, slice(start, start + count)))
        start += count
    return rows


def balanced_groups(counts: list[int], groups: int) -> list[list[int]]:
    """Experts with rows in ``groups`` lists of near-equal total rows (largest first onto the lightest group)."""
    loads, members = [0] * groups, [[] for _ in range(groups)]
    for expert in sorted((e for e, c in enumerate(counts) if c), key=lambda e: -counts[e]):
        lightest = loads.index(min(loads))
        members[lightest].append(expert)
        loads[lightest] += counts[expert]
    return [sorted(group) for group in members if group]


def _set_worker_threads(threads: int) -> None:
    torch.get_num_threads()  # this thread's first call sets its count from the process's; only then override it
    torch.set_num_threads(threads)


def _pool(workers: int, threads_each: int) -> ThreadPoolExecutor:
    """Persistent daemon workers with ``threads_each`` intra-op threads each (made once per shape)."""
    with _WORKERS.lock:
        pool = _WORKERS.pools.get((workers, threads_each))
        if pool is None:
            process_threads = torch.get_num_threads()
            pool = ThreadPoolExecutor(workers, thread_name_prefix="xscale-experts")
            ready = threading.Barrier(workers + 1)

            def start() -> None:
                _set_worker_threads(threads_each)
                ready.wait()  # every worker holds a thread of its own before the next starts

            for _ in range(workers):
                pool.submit(start)
            ready.wait()
            torch.set_num_threads(process_threads)  # the workers' override also set the count new threads start with
            _WORKERS.pools[workers, threads_each] = pool
        return pool


def _run_group(work: Work, experts: list[int], rows: dict[int, slice]) -> None:
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for expert in experts:
            work(expert, rows[expert])


def for_each_expert(work: Work, counts: list[int], device: torch.device) -> None:
    """``work(expert, rows)`` for every expert with rows (see the module docstring for how they are scheduled)."""
    rows = dict(expert_rows(counts))
    threads = torch.get_num_threads()
    groups = balanced_groups(counts, min(threads, len(rows))) if rows else []
    if device.type != "cpu" or len(groups) < 2:
        _run_group(work, sorted(rows), rows)
        return
    threads_each = max(1, threads // len(groups))
    pool = _pool(len(groups) - 1, threads_each)
    pending = [pool.submit(_run_group, work, group, rows) for group in groups[1:]]
    torch.set_num_threads(threads_each)
    try:
        _run_group(work, groups[0], rows)
    finally:
        torch.set_num_threads(threads)
        for future in pending:
            future.result()
