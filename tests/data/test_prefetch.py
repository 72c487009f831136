"""The prefetcher loads step s+1 while step s computes, and still returns each step's own batch."""

from __future__ import annotations

import threading

from xscale.data.prefetch import Prefetcher


def test_the_next_batch_loads_in_the_background():
    loaded, started = [], {}

    def load(step):
        started[step] = threading.current_thread().name
        loaded.append(step)
        return f"batch {step}"

    prefetcher = Prefetcher(load)
    assert prefetcher.get(0) == "batch 0"
    assert prefetcher.get(1) == "batch 1"  # loaded ahead: not loaded again
    assert prefetcher.get(2, prefetch_next=False) == "batch 2"
    prefetcher.close()
    assert loaded == [0, 1, 2]
    assert started[0] == threading.current_thread().name and started[1].startswith("xscale-prefetch")


def test_a_step_out_of_order_is_loaded_in_place():
    gate = threading.Event()

    def load(step):
        if step == 1:
            gate.wait(5)  # the read-ahead of step 1 is still in flight when step 5 is asked for
        return step * 10

    prefetcher = Prefetcher(load)
    assert prefetcher.get(0) == 0
    gate.set()
    assert prefetcher.get(5) == 50  # e.g. after a resume: the batch read ahead is dropped
    assert prefetcher.get(6) == 60
    prefetcher.close()
