"""Real torchrun jobs on this machine (2 gloo workers): a stopped rank ends the job in seconds with the rank named;
a killed torchrun agent takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

STEP_TIMEOUT_S = 4
TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.steps=100000",
        "train.global_batch_size=4", "train.seq_len=16", "train.log_every=1", "train.tensorboard=false",
        "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0", "checkpoint.every=0"]


# Steps of ~0.1-0.3 s here, so that the rank is stopped within the first 5 steps, before the auto limit has a median.
SLOWER_STEPS = ["train.seq_len=128", "train.global_batch_size=32", "model.d_model=64"]


def _start(output_dir: Path, *extra: str, launcher: str = "xscale.launcher.torchrun") -> subprocess.Popen:
    """The job under xscale's torchrun (or plain torchrun: ``torch.distributed.run``), in its own session so that a
    test can signal its process group as a terminal's Ctrl-C does."""
    command = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node=2",
               "-m", "xscale", "train", *TINY, f"train.output_dir={output_dir}", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _workers(agent: subprocess.Popen, output_dir: Path, timeout: float = 180,
             steps: int = 3) -> dict[int, psutil.Process]:
    """Rank -> worker process, once both train (metrics.jsonl has ``steps`` steps)."""
    deadline = time.monotonic() + timeout
    metrics = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert agent.poll() is None, agent.communicate()
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            children = psutil.Process(agent.pid).children()
            return {int(child.environ()["RANK"]): child for child in children}
        time.sleep(0.02)
    pytest.fail("the job did not start training in time")


def _cleanup(agent: subprocess.Popen, workers: dict[int, psutil.Process]) -> None:
    for process in [*workers.values(), psutil.Process(agent.pid) if agent.poll() is None else None]:
        if process is not None and process.is_running():
            process.send_signal(signal.SIGCONT)
            process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["train.step_timeout_s", "train.first_step_timeout_s"], ids=["set", "first-steps"])
def test_a_stopped_rank_ends_the_job_with_exit_3_within_the_limit_naming_it(tmp_path, limit):
    """A rank SIGSTOPped at step 2: with train.step_timeout_s, or in auto mode before any median exists (the first
    step limit), the watchdog names it, SIGKILLs it (no 30 s of torchrun's SIGTERM grace) and the job exits 3."""
    agent = _start(tmp_path, f"{limit}={STEP_TIMEOUT_S}", *SLOWER_STEPS)
    workers = {}
    try:
        workers = _workers(agent, tmp_path, steps=1)
        workers[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = agent.communicate(timeout=STEP_TIMEOUT_S + 120)
        took = time.monotonic() - stopped
    finally:
        _cleanup(agent, workers)
    assert agent.returncode == 3, stderr[-3000:]
    assert took < STEP_TIMEOUT_S + 15, took
    assert "xscale watchdog: rank 0" in stderr and "rank 1: silent for" in stderr, stderr[:2000]
    assert f"{limit}={STEP_TIMEOUT_S}" in stderr  # the first steps' limit, not the median's
    assert "xscale torchrun: a hung rank was ended by the watchdog" in stderr


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_with_one_line(tmp_path):
    """SIGINT to the job's process group (a terminal's Ctrl-C): the workers finish the step, save, rank 0 prints one
    line and the job exits 130 with no traceback."""
    agent = _start(tmp_path, "train.first_step_timeout_s=60")
    workers = {}
    try:
        workers = _workers(agent, tmp_path)
        os.killpg(agent.pid, signal.SIGINT)
        stdout, stderr = agent.communicate(timeout=120)
    finally:
        _cleanup(agent, workers)
    assert agent.returncode == 130, stderr[-3000:]
    (line,) = [line for line in stdout.splitlines() if line.startswith("interrupted at step")]
    step = int(line.split()[3].rstrip(";"))
    assert f"checkpoint saved to {tmp_path / 'checkpoints' / f'step_{step:08d}'}; resume with: torchrun " in line
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert len(stderr.strip().splitlines()) <= 3, stderr


def test_killing_the_torchrun_agent_ends_its_workers(tmp_path):
    agent = _start(tmp_path)
    workers = {}
    try:
        workers = _workers(agent, tmp_path)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        gone, alive = psutil.wait_procs(list(workers.values()), timeout=20)
    finally:
        _cleanup(agent, workers)
    assert not alive, f"workers outlived their agent: {[p.pid for p in alive]}"
