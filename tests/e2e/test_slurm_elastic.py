"""A real two-node Slurm cluster and a job submitted with `--nodes 2 --min-nodes 1`. Shrink: preempted while one
node is drained, Slurm requeues it on the node left, and the run resumes there on half the ranks with the same global
batch (gradient accumulation). Grow back: started on one node while the other is drained, preempted once the node
is back, requeued on both nodes, and resumed on twice the ranks with one microbatch each. Both end at the same losses
as one process within fp32 round-off."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from cluster_tools import TINY_CONFIG, Cluster, Job, latest_step, losses_by_step, run

pytestmark = pytest.mark.cluster

STEPS = 20  # tiny.yaml's train.steps
JOB_TIMEOUT = 300
LOSS_RTOL = 1e-5  # 4 ranks, then 2 ranks x 2 microbatches, against one process: sums in another order (fp32)
LOST_NODE = "node2"


def test_a_requeued_job_resumes_on_the_node_left_with_the_same_global_batch(cluster: Cluster, tmp_path: Path,
                                                                           single_process_run: Path):
    job = submit_elastic(cluster, tmp_path)
    cluster.wait_for(job, r"^step 2/20 ", timeout=JOB_TIMEOUT)
    run(["scontrol", "update", f"nodename={LOST_NODE}", "state=drain", "reason=xscale-elastic-test"], timeout=60,
        cwd=tmp_path)
    try:  # the job checkpoints and is requeued; Slurm can only give it the other node now
        run(["scancel", "--signal=USR1", "--batch", job.job_id], timeout=60, cwd=tmp_path)
        state, restarts = cluster.wait_until_done(job, timeout=JOB_TIMEOUT)
    finally:
        run(["scontrol", "update", f"nodename={LOST_NODE}", "state=resume"], timeout=60, cwd=tmp_path)
    output = job.text()
    assert (state, restarts) == ("COMPLETED", 1), output
    assert "(restart 0) on node[1-2]: 2 of 1-2 nodes x 2 processes = world 4" in output, output
    assert "(restart 1) on node1: 1 of 1-2 nodes x 2 processes = world 2" in output, output
    assert ("elastic resume: 2 data-parallel rank(s), the checkpoint ran 4; global batch 8 kept, each rank runs 2 "
            "microbatch(es) of 2 per step (gradient accumulation)") in output, output
    resumed_at = int(cluster.wait_for(job, r"resumed from \S+ at step (\d+)", timeout=1).group(1))
    assert 2 <= resumed_at < STEPS, output

    assert_same_losses_as_one_process(tmp_path / "run", single_process_run)


def test_a_job_started_on_one_node_grows_back_to_two_when_the_node_returns(cluster: Cluster, tmp_path: Path,
                                                                          single_process_run: Path):
    run(["scontrol", "update", f"nodename={LOST_NODE}", "state=drain", "reason=xscale-elastic-test"], timeout=60,
        cwd=tmp_path)
    try:  # Slurm starts the job on the one node it has (min 1); it comes back while the job runs
        job = submit_elastic(cluster, tmp_path)
        cluster.wait_for(job, r"^step 2/20 ", timeout=JOB_TIMEOUT)
    finally:
        run(["scontrol", "update", f"nodename={LOST_NODE}", "state=resume"], timeout=60, cwd=tmp_path)
    run(["scancel", "--signal=USR1", "--batch", job.job_id], timeout=60, cwd=tmp_path)
    state, restarts = cluster.wait_until_done(job, timeout=JOB_TIMEOUT)
    output = job.text()
    assert (state, restarts) == ("COMPLETED", 1), output
    assert "(restart 0) on node1: 1 of 1-2 nodes x 2 processes = world 2" in output, output
    assert "(restart 1) on node[1-2]: 2 of 1-2 nodes x 2 processes = world 4" in output, output
    assert ("elastic resume, grown back: 4 data-parallel rank(s), the checkpoint ran 2; global batch 8 kept, each "
            "rank runs 1 microbatch(es) of 2 per step") in output, output
    resumed_at = int(cluster.wait_for(job, r"resumed from \S+ at step (\d+)", timeout=1).group(1))
    assert 2 <= resumed_at < STEPS, output
    assert_same_losses_as_one_process(tmp_path / "run", single_process_run)


def submit_elastic(cluster: Cluster, tmp_path: Path) -> Job:
    """The tiny run as 2 nodes x 2 processes that may shrink to one node (``--min-nodes 1``)."""
    return cluster.submit([str(TINY_CONFIG), f"train.output_dir={tmp_path / 'run'}", "--nodes", "2", "--min-nodes",
                           "1", "--nproc-per-node", "2", "--gpus-per-node", "0", "--partition", cluster.partition,
                           "--time", "10", "--signal-seconds", "60"], cwd=tmp_path)


def assert_same_losses_as_one_process(run_dir: Path, single_process_run: Path) -> None:
    """The run finished every step once, each loss within fp32 round-off of the one-process run's."""
    step, _ = latest_step(run_dir / "checkpoints")
    assert step == STEPS
    losses, reference = losses_by_step(run_dir / "metrics.jsonl"), losses_by_step(single_process_run / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for index in losses:
        assert math.isclose(losses[index], reference[index], rel_tol=LOSS_RTOL), (index, losses[index],
                                                                                 reference[index])
