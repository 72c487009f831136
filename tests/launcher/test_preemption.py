"""PreemptionHandler: signals and the stop file set the flag; every rank agrees; requeue asks Slurm once."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from xscale.launcher import preemption
from xscale.launcher.local import start_local
from xscale.launcher.preemption import PreemptionHandler


def test_usr1_sets_the_flag_and_uninstall_restores_the_old_handler():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler(stop_file=None) as handler:
        assert not handler.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1
        assert handler.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_sigterm_sets_the_flag():
    with PreemptionHandler(stop_file=None) as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.should_stop()


def test_stop_file_from_the_environment(tmp_path, monkeypatch):
    stop = tmp_path / "stop"
    monkeypatch.setenv("XSCALE_STOP_FILE", str(stop))
    handler = PreemptionHandler(signals=())
    assert not handler.should_stop()
    stop.touch()
    assert handler.should_stop()


def _agree(rank: int, world_size: int, store: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        handler = PreemptionHandler(signals=(), stop_file=None)
        first = handler.should_stop()
        if rank == world_size - 1:
            handler.received = signal.SIGUSR1  # only the last rank was signalled
        second = handler.should_stop()
        results[rank] = (first, second)
    finally:
        dist.destroy_process_group()


def test_all_ranks_stop_at_the_same_step(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    start_local(_agree, 2, (2, str(tmp_path / "store"), results))
    assert dict(results) == {0: (False, True), 1: (False, True)}


def test_requeue_outside_slurm_does_nothing(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(preemption.subprocess, "run", lambda *a, **k: pytest.fail("scontrol must not run"))
    assert PreemptionHandler(signals=()).requeue() is False


def test_requeue_leaves_the_file_for_the_job_script(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("XSCALE_REQUEUE_FILE", str(tmp_path / "requeue"))
    monkeypatch.setattr(preemption.subprocess, "run", lambda *a, **k: pytest.fail("scontrol must not run"))
    assert PreemptionHandler(signals=()).requeue() is True
    assert (tmp_path / "requeue").exists()


def test_requeue_runs_scontrol_in_a_plain_slurm_job(monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("XSCALE_REQUEUE_FILE", raising=False)
    monkeypatch.setattr(preemption.subprocess, "run", fake_run)
    assert PreemptionHandler(signals=()).requeue() is True
    assert calls == [["scontrol", "requeue", "42"]]
