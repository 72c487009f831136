"""A one-batch-ahead loader: while step s computes, a background thread loads step s+1's batch, so the step time
(which includes waiting for data) pays for loading only when loading is slower than a step.

Samples are pure functions of (data, seed, index) (:mod:`xscale.data.datasets`), so loading on another thread reads
exactly what loading in place would.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Batch = TypeVar("Batch")


class Prefetcher(Generic[Batch]):
    """``get(step)`` returns ``load(step)`` and starts loading ``step + 1`` in the background."""

    def __init__(self, load: Callable[[int], Batch]) -> None:
        self._load = load
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future[Batch]] | None = None

    def get(self, step: int, prefetch_next: bool = True) -> Batch:
        """Step ``step``'s batch: the one loaded ahead if it is that step's, else loaded now (the first step, after a
        resume or an out-of-order read). ``prefetch_next``: start loading ``step + 1`` (False after the last step)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            batch = pending[1].result()
        else:
            if pending is not None:
                pending[1].result()  # another step's batch: let it finish, then drop it
            batch = self._load(step)
        if prefetch_next:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xscale-prefetch")
            self._pending = (step + 1, self._executor.submit(self._load, step + 1))
        return batch

    def close(self) -> None:
        """Wait for a batch in flight and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor, self._pending = None, None
