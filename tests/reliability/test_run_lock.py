"""One live job per output directory: a second job is refused in one line; a dead job's lock is taken over."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from xscale.train.run_lock import LOCK_NAME, STALE_AFTER_S, RunLock, RunLocked


def _write_lock(directory, **holder):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "started": "then", **holder}))


@pytest.fixture
def live_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_live_job_on_this_host_keeps_its_directory(tmp_path, live_process, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, pid=live_process.pid)
    with pytest.raises(RunLocked, match=rf"in use by another xscale job .*pid {live_process.pid}.*train.output_dir"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == live_process.pid  # untouched


def test_the_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, capsys):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lock(tmp_path, pid=int(finished.stdout))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "taking over the stale lock" in capsys.readouterr().out
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_a_requeued_slurm_job_takes_over_its_earlier_run(tmp_path, live_process, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _write_lock(tmp_path, host="another-node", pid=live_process.pid, slurm_job_id="4242")
    with RunLock(tmp_path):
        pass
    _write_lock(tmp_path, host="another-node", pid=live_process.pid, slurm_job_id="1")
    with pytest.raises(RunLocked, match="Slurm job 1"):
        RunLock(tmp_path).acquire()


def test_a_lock_not_refreshed_for_long_is_stale(tmp_path, live_process, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, host="another-node", pid=live_process.pid)
    old = time.time() - STALE_AFTER_S - 10
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with RunLock(tmp_path) as lock:
        assert lock.held


def test_the_cli_refuses_a_second_job_with_exit_2(tmp_path, live_process, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, pid=live_process.pid)
    result = subprocess.run([sys.executable, "-m", "xscale", "train", f"train.output_dir={tmp_path}", "train.steps=1",
                             "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "train.plot=false",
                             "train.tensorboard=false"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "in use by another xscale job" in result.stderr and "Traceback" not in result.stderr
    # refused before the data, tokenizer or model were built: nothing written into the directory
    assert [path.name for path in tmp_path.iterdir()] == [LOCK_NAME]


def _contend(directory, barrier, results, index):
    barrier.wait()
    try:
        RunLock(directory).acquire()
        results[index] = 1
    except RunLocked:
        results[index] = 0
    barrier.wait()  # the holder lives until every contender has tried: a holder that exited is stale (taken over)


@pytest.mark.parametrize("stale", [False, True], ids=["fresh directory", "stale lock to take over"])
def test_two_jobs_locking_at_the_same_instant_never_both_hold_it(tmp_path, stale, monkeypatch):
    """Three processes released together by a barrier, 40 times: exactly one holds the lock each time (the lock was
    created empty and then written, so a reader could take the empty file for stale: 13 of 100 trials held twice)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    context = multiprocessing.get_context("fork")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for trial in range(40):
        directory = tmp_path / str(trial)
        if stale:
            _write_lock(directory, pid=int(gone.stdout), token="old")
        barrier, results = context.Barrier(3), context.Array("i", [-1, -1, -1])
        workers = [context.Process(target=_contend, args=(directory, barrier, results, i)) for i in range(3)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        assert sorted(results) == [0, 0, 1], f"trial {trial}: {list(results)}"
        assert [path.name for path in directory.iterdir()] == [LOCK_NAME]  # no private or moved-aside file left
