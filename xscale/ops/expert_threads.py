"""Per-expert work spread over the CPU's threads: experts side by side, not threads inside each expert's GEMM.

E experts' GEMMs of a few hundred rows each, every one split over all intra-op threads, pay a team wake-up and a
load imbalance per GEMM; on 2 cores eight 512-row expert GEMMs ran 1.18-1.22x the time of the one 4096-row dense
GEMM of the same FLOPs. Giving each thread whole experts (the CPU analogue of a grouped GEMM's tiles over
experts) with one intra-op thread each brings them to 0.97-1.06x (``xscale bench moe``, experts only vs dense).

:func:`for_each_expert` runs ``work(expert, rows)`` for every expert with rows: one after another on accelerators,
with one thread, or with a single expert; otherwise each of min(threads, experts) runners (the calling thread and
persistent worker threads, ``threads // runners`` intra-op threads each) takes the largest expert left from a shared
queue until none is left (``torch.set_num_threads(1)`` runs them one after another). Taking from a queue, not a
split fixed in advance, balances what the row counts do not show: on a shared 2-core machine one core often runs
slower for a while. Against groups balanced by row count, the MoE layer's step over the dense FFN's went from
1.15-1.29x to 1.13-1.21x, lower in each of six alternating runs (``xscale bench moe --ep 1``, AVX-512 machine,
2026-11-28). Which thread runs an expert does not change its numbers (a single-threaded GEMM each). ``work`` must
write only its own rows of preallocated outputs; it runs under ``torch.no_grad()`` with autocast off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from xscale.ops.intra_op_threads import intra_op_threads

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


class _LargestFirst:
    """The experts still to run, largest row count first, taken by several threads."""

    def __init__(self, counts: list[int], experts: list[int]) -> None:
        self.left = sorted(experts, key=lambda expert: (-counts[expert], expert))
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            return self.left.pop(0) if self.left else None


@contextlib.contextmanager
def _plain_arithmetic() -> Iterator[None]:
    """What ``work`` runs under on every path: no autograd graph, autocast off (the caller chose the dtypes)."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        yield


def _drain(work: Work, queue: _LargestFirst, rows: dict[int, slice]) -> None:
    with _plain_arithmetic():
        while (expert := queue.take()) is not None:
            work(expert, rows[expert])


def for_each_expert(work: Work, counts: list[int], device: torch.device) -> None:
    """``work(expert, rows)`` for every expert with rows (see the module docstring for how they are scheduled)."""
    rows = dict(expert_rows(counts))
    threads = torch.get_num_threads()
    runners = min(threads, len(rows))
    if device.type != "cpu" or runners < 2:
        with _plain_arithmetic():
            for expert in sorted(rows):
                work(expert, rows[expert])
        return
    threads_each = max(1, threads // runners)
    pool = _pool(runners - 1, threads_each)
    queue = _LargestFirst(counts, list(rows))
    pending = [pool.submit(_drain, work, queue, rows) for _ in range(runners - 1)]
    try:
        with intra_op_threads(threads_each):
            _drain(work, queue, rows)
    finally:
        for future in pending:
            future.result()
