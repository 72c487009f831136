"""Client-side helpers for the cluster tier: submit, poll and read jobs the way a user would, and read runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = Path(__file__).with_name("tiny.yaml")
# .ci/cluster.sh's configuration, unless the environment names another cluster.
CLUSTER_DIR = Path(os.environ.get("XSCALE_CLUSTER_DIR", "/tmp/xscale-cluster"))
SLURM_CONF = os.environ.get("SLURM_CONF") or str(CLUSTER_DIR / "etc" / "slurm.conf")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def job_environ(**extra: str) -> dict[str, str]:
    """The environment jobs and launchers inherit: this worktree's xscale, one thread per rank."""
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC",
                                      "OMPI_", "PMI", "XSCALE_STOP", "XSCALE_REQUEUE", "XSCALE_BOOTSTRAP"))}
    environ["SLURM_CONF"] = SLURM_CONF
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "kernels")])
    environ["OMP_NUM_THREADS"] = "1"
    environ.update(extra)
    return environ


def run(command: list[str], *, timeout: float, cwd: Path, check: bool = True, **extra: str) -> str:
    """Run a client command (sbatch, srun, a launcher); return stdout + stderr, failing with both shown."""
    result = subprocess.run(command, env=job_environ(**extra), cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}:\n{output[-4000:]}")
    return output


@dataclass
class Job:
    """A batch job submitted by a test, and where its output lands."""

    job_id: str
    output: Path

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


class Cluster:
    """Client-side helpers for the running cluster (its partition: $XSCALE_CLUSTER_PARTITION, default ci)."""

    def __init__(self) -> None:
        self.partition = os.environ.get("XSCALE_CLUSTER_PARTITION", "ci")

    def submit(self, argv: list[str], cwd: Path, **extra: str) -> Job:
        """``xscale submit ...`` from ``cwd`` (``extra``: environment the job inherits); returns the job and its
        output file as printed by submit."""
        pinned = [] if "--python" in argv else ["--python", sys.executable]  # the nodes are this machine
        output = run([sys.executable, "-m", "xscale", "submit", *pinned, *argv], timeout=120, cwd=cwd, **extra)
        job_id = re.search(r"Submitted batch job (\d+)", output)
        log = re.search(r"^logs: (.+)$", output, re.MULTILINE)
        assert job_id and log, output
        return Job(job_id.group(1), Path(log.group(1)))

    def sbatch_template(self, argv: list[str], cwd: Path, nproc_per_node: int) -> Job:
        """``sbatch launch/slurm.sbatch ARGV`` with the template's GPU and CPU requests replaced for CPU nodes."""
        output = cwd / "slurm-%j.out"
        submitted = run(["sbatch", f"--partition={self.partition}", "--gpus-per-node=0", "--cpus-per-task=2",
                         "--time=10", f"--output={output}", str(REPO / "launch" / "slurm.sbatch"), *argv],
                        timeout=120, cwd=cwd, NPROC_PER_NODE=str(nproc_per_node),
                        XSCALE_LAUNCH_DIR=str(REPO / "launch"), PYTHON=sys.executable)
        job_id = re.search(r"Submitted batch job (\d+)", submitted)
        assert job_id, submitted
        return Job(job_id.group(1), cwd / f"slurm-{job_id.group(1)}.out")

    def state(self, job: Job) -> tuple[str, int]:
        """(JobState, Restarts) from scontrol; ('UNKNOWN', 0) while slurmctld does not answer."""
        result = subprocess.run(["scontrol", "show", "job", job.job_id], env=job_environ(), capture_output=True,
                                text=True, timeout=60)
        if result.returncode != 0:
            return "UNKNOWN", 0
        state = re.search(r"JobState=(\S+)", result.stdout)
        restarts = re.search(r"Restarts=(\d+)", result.stdout)
        return (state.group(1) if state else "UNKNOWN"), int(restarts.group(1)) if restarts else 0

    def wait_for(self, job: Job, pattern: str, timeout: float) -> re.Match:
        """Poll the job's output until ``pattern`` shows up (fails early if the job ended without it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, _ = self.state(job)
            match = re.search(pattern, job.text(), re.MULTILINE)
            if match:
                return match
            if state in FINAL_STATES:
                raise AssertionError(f"job {job.job_id} ended {state} without printing {pattern!r}:\n{job.text()}")
            time.sleep(0.25)
        raise AssertionError(f"job {job.job_id}: no {pattern!r} within {timeout:.0f} s:\n{job.text()[-4000:]}")

    def wait_until_done(self, job: Job, timeout: float) -> tuple[str, int]:
        """Wait for a final state; returns (state, restarts). A requeued job passes through PENDING again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, restarts = self.state(job)
            if state in FINAL_STATES:
                return state, restarts
            time.sleep(1.0)
        run(["scancel", job.job_id], timeout=60, cwd=REPO, check=False)
        raise AssertionError(f"job {job.job_id} still {self.state(job)} after {timeout:.0f} s:\n{job.text()[-4000:]}")


def losses_by_step(metrics_file: Path) -> dict[int, float]:
    """step -> train/loss from a run's metrics.jsonl (rank 0 writes it; appended across restarts)."""
    losses = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            losses[int(record["step"])] = float(record["train/loss"])
    return losses


def latest_step(checkpoint_root: Path) -> tuple[int, Path]:
    """(step recorded in meta.json, step directory) of the checkpoint ``latest`` names."""
    step_dir = checkpoint_root / (checkpoint_root / "latest").read_text().strip()
    return int(json.loads((step_dir / "meta.json").read_text())["step"]), step_dir
