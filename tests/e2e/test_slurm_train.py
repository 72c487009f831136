"""A real two-node Slurm cluster: a dp=4 job from `xscale submit` trains to the end; a preempted job (from
`xscale submit` and from launch/slurm.sbatch) and a job hit by the chaos soak's in-worker faults (a NaN, a full disk
during a save; each failure requeued by the job script) resume exactly.

Every job runs 2 nodes x 2 CPU processes (torchrun per node, c10d rendezvous on node 1, gloo). The uninterrupted
job is also the reference of the preempted ones: after USR1, checkpoint, `scontrol requeue` and a resume from
`latest`, a preempted job's final parameters must equal the uninterrupted job's bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cluster_tools import TINY_CONFIG, Cluster, Job, latest_step, losses_by_step, run
from safetensors.torch import load_file

from xscale.commands.export import export_safetensors
from xscale.launcher.chaos.plan import PLAN_VARIABLE, ChaosFiles, Fault

pytestmark = pytest.mark.cluster

STEPS = 20  # tiny.yaml's train.steps
JOB_TIMEOUT = 300
# Single process vs 4 data-parallel ranks: the same global batch, gradients averaged in another order (fp32).
LOSS_RTOL = 1e-5


@dataclass
class FinishedJob:
    job: Job
    run_dir: Path
    state: str
    restarts: int


def submit_tiny(cluster: Cluster, workdir: Path) -> Job:
    return cluster.submit([str(TINY_CONFIG), f"train.output_dir={workdir / 'run'}", "--nodes", "2",
                           "--nproc-per-node", "2", "--gpus-per-node", "0", "--partition", cluster.partition,
                           "--time", "10", "--signal-seconds", "60"], cwd=workdir)


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> FinishedJob:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    job = submit_tiny(cluster, workdir)
    state, restarts = cluster.wait_until_done(job, timeout=JOB_TIMEOUT)
    return FinishedJob(job, workdir / "run", state, restarts)


def test_two_node_job_trains_to_the_end(uninterrupted: FinishedJob, single_process_run: Path):
    output = uninterrupted.job.text()
    assert (uninterrupted.state, uninterrupted.restarts) == ("COMPLETED", 0), output
    assert "2 nodes x 2 processes = world 4" in output
    # One process group over both nodes, not two worlds of 2 (those would print the same losses).
    assert "xscale world: launcher=torchrun world_size=4 nodes=2 local_world_size=2" in output, output
    assert "job step exited with status 0" in output
    step, _ = latest_step(uninterrupted.run_dir / "checkpoints")
    assert step == STEPS
    losses = losses_by_step(uninterrupted.run_dir / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    reference = losses_by_step(single_process_run / "metrics.jsonl")
    for index in losses:
        assert math.isclose(losses[index], reference[index], rel_tol=LOSS_RTOL), (index, losses[index],
                                                                                 reference[index])
    assert losses[STEPS] < losses[1], "the model did not train"


@pytest.mark.parametrize("submission", ["xscale-submit", "sbatch-template"])
def test_preempted_job_checkpoints_requeues_and_resumes_exactly(cluster: Cluster, uninterrupted: FinishedJob,
                                                                tmp_path: Path, submission: str):
    if submission == "xscale-submit":
        job = submit_tiny(cluster, tmp_path)
    else:  # launch/slurm.sbatch, what users copy and edit
        job = cluster.sbatch_template([str(TINY_CONFIG), f"train.output_dir={tmp_path / 'run'}"], tmp_path,
                                      nproc_per_node=2)
    # USR1 to the batch shell as soon as training runs, the way Slurm warns before the time limit.
    cluster.wait_for(job, r"^step 2/20 ", timeout=JOB_TIMEOUT)
    run(["scancel", "--signal=USR1", "--batch", job.job_id], timeout=60, cwd=tmp_path)
    state, restarts = cluster.wait_until_done(job, timeout=JOB_TIMEOUT)
    output = job.text()
    assert (state, restarts) == ("COMPLETED", 1), output
    assert "USR1 received" in output
    assert f"scontrol requeue {job.job_id}" in output
    resumed = cluster.wait_for(job, r"resumed from \S+ at step (\d+)", timeout=1)
    resumed_at = int(resumed.group(1))
    assert 2 <= resumed_at < STEPS, f"the USR1 did not stop the run mid-way (resumed at {resumed_at})\n{output}"
    assert output.count("xscale world: launcher=torchrun world_size=4 nodes=2") == 2

    step, step_dir = latest_step(tmp_path / "run" / "checkpoints")
    assert step == STEPS
    _, reference_dir = latest_step(uninterrupted.run_dir / "checkpoints")
    preempted = load_file(export_safetensors(step_dir, tmp_path / "preempted.safetensors"))
    reference = load_file(export_safetensors(reference_dir, tmp_path / "uninterrupted.safetensors"))
    assert preempted.keys() == reference.keys()
    for name in reference:
        assert torch.equal(preempted[name], reference[name]), (
            f"{name}: max difference {(preempted[name] - reference[name]).abs().max().item():.3e}")
    # The steps after the resume repeat the uninterrupted run's losses exactly (same data, RNG and optimizer).
    losses, reference_losses = (losses_by_step(tmp_path / "run" / "metrics.jsonl"),
                                losses_by_step(uninterrupted.run_dir / "metrics.jsonl"))
    assert {s: losses[s] for s in range(resumed_at + 1, STEPS + 1)} == {
        s: reference_losses[s] for s in range(resumed_at + 1, STEPS + 1)}


def test_a_nan_and_a_full_disk_are_requeued_and_the_job_ends_bit_identical(cluster: Cluster,
                                                                           uninterrupted: FinishedJob, tmp_path: Path):
    files = ChaosFiles(tmp_path / "chaos")
    faults = [Fault(0, "nan", step=7, rank=0), Fault(1, "disk_full", step=12, rank=0)]  # checkpoints every 5 steps
    files.write_plan(faults)
    job = cluster.submit([str(TINY_CONFIG), f"train.output_dir={tmp_path / 'run'}", "--nodes", "2",
                          "--nproc-per-node", "2", "--gpus-per-node", "0", "--partition", cluster.partition,
                          "--time", "10", "--max-requeues", "2"], cwd=tmp_path, **{PLAN_VARIABLE: str(files.plan)})
    state, restarts = cluster.wait_until_done(job, timeout=2 * JOB_TIMEOUT)
    output = job.text()
    assert (state, restarts) == ("COMPLETED", 2), output
    assert all(files.fired_at(fault) for fault in faults), output
    assert "training diverged: step 7: loss nan" in output and "could not write checkpoint" in output
    assert "resumed from" in output and "at step 5" in output and "at step 10" in output

    step, step_dir = latest_step(tmp_path / "run" / "checkpoints")
    assert step == STEPS
    _, reference_dir = latest_step(uninterrupted.run_dir / "checkpoints")
    faulted = load_file(export_safetensors(step_dir, tmp_path / "faulted.safetensors"))
    reference = load_file(export_safetensors(reference_dir, tmp_path / "uninterrupted.safetensors"))
    assert faulted.keys() == reference.keys()
    assert all(torch.equal(faulted[name], reference[name]) for name in reference)
    assert losses_by_step(tmp_path / "run" / "metrics.jsonl") == losses_by_step(uninterrupted.run_dir / "metrics.jsonl")
