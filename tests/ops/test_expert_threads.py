"""for_each_expert: every expert with rows runs once on its rows, side by side on the CPU threads, and leaves the
process's thread settings as it found them; grouped_mlp gives the same numbers threaded and serial."""

import multiprocessing
import threading

import pytest
import torch

from xscale.ops.expert_threads import expert_rows, for_each_expert
from xscale.ops.grouped_mlp import grouped_mlp

CPU = torch.device("cpu")


def test_expert_rows_skip_empty_experts_and_follow_the_sorted_rows():
    assert expert_rows([2, 0, 3, 1]) == [(0, slice(0, 2)), (2, slice(2, 5)), (3, slice(5, 6))]


def test_two_threads_take_the_largest_experts_first_from_one_queue(two_threads):
    """Each runner takes the largest expert left; the barrier holds both runners on their first expert, so the first
    two taken are the two largest (and a single runner taking everything fails the barrier)."""
    counts = [500, 0, 480, 530, 470, 510, 0, 520]
    taken, lock, both = [], threading.Lock(), threading.Barrier(2, timeout=30)

    def work(expert, rows):
        with lock:
            taken.append(expert)
            first_two = len(taken) <= 2
        if first_two:
            both.wait()

    for_each_expert(work, counts, CPU)
    assert set(taken[:2]) == {3, 7}
    assert sorted(taken) == [0, 2, 3, 4, 5, 7]


def test_every_expert_runs_once_on_its_rows_on_two_threads_each_with_one_intra_op_thread(two_threads):
    counts = [3, 0, 5, 1, 4, 2]
    seen, lock = {}, threading.Lock()

    both = threading.Barrier(2, timeout=30)  # each runner holds its first expert until the other has one

    def work(expert, rows):
        with lock:
            seen[expert] = (rows, threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled())
            first_two = len(seen) <= 2
        if first_two:
            both.wait()

    for_each_expert(work, counts, CPU)
    assert {e: s[0] for e, s in seen.items()} == dict(expert_rows(counts))
    assert len({s[1] for s in seen.values()}) == 2, "the experts were not shared between two threads"
    assert {s[2] for s in seen.values()} == {1}
    assert not any(s[3] for s in seen.values())
    assert torch.get_num_threads() == 2
    fresh = []
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [2], "a thread started afterwards must get the process's thread count"


def test_one_thread_runs_the_experts_on_the_calling_thread(two_threads):
    threads = set()
    torch.set_num_threads(1)
    for_each_expert(lambda expert, rows: threads.add(threading.get_ident()), [2, 2, 2], CPU)
    assert threads == {threading.get_ident()}


def test_a_failing_expert_raises_in_the_caller(two_threads):
    def work(expert, rows):
        if expert == 3:
            raise RuntimeError("expert 3 failed")

    with pytest.raises(RuntimeError, match="expert 3 failed"):
        for_each_expert(work, [4, 4, 4, 4], CPU)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("gated", [False, True], ids=["mlp", "gated"])
def test_grouped_mlp_threaded_equals_serial(two_threads, gated):
    torch.manual_seed(0)
    counts, d, hidden = [40, 0, 70, 25, 64], 32, 48
    experts = len(counts)
    leaves = [torch.randn(sum(counts), d), torch.randn(experts, hidden, d), torch.randn(experts, hidden),
              torch.randn(experts, d, hidden), torch.randn(experts, d)]
    if gated:
        leaves += [torch.randn(experts, hidden, d), torch.randn(experts, hidden)]
    leaves = [t.requires_grad_() for t in leaves]
    upstream = torch.randn(sum(counts), d)

    def run():
        out = grouped_mlp(leaves[0], counts, "silu", *leaves[1:5], *leaves[5:])
        return [out, *torch.autograd.grad((out * upstream).sum(), leaves)]

    threaded = run()
    torch.set_num_threads(1)
    serial = run()
    for got, expected in zip(threaded, serial):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _experts_in_forked_child(queue):
    seen = []
    for_each_expert(lambda expert, rows: seen.append(expert), [3, 3, 3, 3], CPU)
    queue.put(sorted(seen))


def test_a_forked_child_makes_its_own_workers(two_threads):
    for_each_expert(lambda expert, rows: None, [3, 3], CPU)  # the parent's workers exist before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_experts_in_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child hung or failed running its experts"
    assert queue.get(timeout=5) == [0, 1, 2, 3]
