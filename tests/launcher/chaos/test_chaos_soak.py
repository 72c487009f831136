"""The chaos soak end to end: 2 torchrun workers, every fault kind once, nothing lost, and the final model and
optimizer state bit-identical to a fault-free run of the same config."""

import re
from pathlib import Path

import pytest

from xscale.checkpoint.memory_snapshot import snapshot_key
from xscale.commands.chaos import TINY
from xscale.launcher.chaos.plan import KINDS
from xscale.launcher.chaos.soak import WARM_MODULES, SoakOptions, run_soak


@pytest.mark.slow
def test_every_fault_kind_is_recovered_and_the_run_ends_bit_identical(tmp_path):
    report = run_soak(SoakOptions(output_dir=tmp_path, overrides=TINY, faults=len(KINDS), nproc=2, seed=1,
                                  timeout_s=1200))
    summary = report["summary"]
    assert sorted(fault["kind"] for fault in report["faults"]) == sorted(KINDS)
    assert summary["recovered"] == summary["faults"] == len(KINDS), report["faults"]
    assert summary["steps_missing"] == [] and summary["loss_mismatch_steps"] == []
    assert summary["bit_identical"] and summary["final_step"] == summary["steps"], summary
    assert all(fault["detection_s"] is not None and fault["lost_s"] is not None for fault in report["faults"])


@pytest.mark.slow
def test_a_killed_worker_resumes_from_memory_past_the_last_checkpoint_and_ends_bit_identical(tmp_path):
    """checkpoint.memory_every=1: torchrun restarts the group after a SIGKILLed worker and it resumes the step in
    /dev/shm (step 14 or later), not the disk checkpoint of step 10; the final state equals the fault-free run's."""
    report = run_soak(SoakOptions(output_dir=tmp_path, overrides=TINY, faults=1, kinds=["kill_worker"], nproc=2,
                                  seed=0, checkpoint_every=5, memory_every=1, timeout_s=300))
    summary, (fault,) = report["summary"], report["faults"]
    assert fault["recovered"] and fault["steps_recomputed"] <= 1, fault  # the step being run when killed, at most
    assert fault["resumed_from"] >= fault["step"] - 1, fault
    log = (tmp_path / "run" / "chaos" / "job.log").read_text()
    resumed = re.search(r"resumed from the memory snapshot of step (\d+) \(newer than the disk checkpoint of step "
                        r"(\d+)", log)
    assert resumed, log[-2000:]
    # A step is logged before its snapshot and its disk save: a kill right after step 15 is logged finds neither.
    disk = int(resumed[2])
    assert int(resumed[1]) == fault["resumed_from"] > disk, (resumed[0], fault)
    assert disk in {fault["step"] // 5 * 5, (fault["step"] - 1) // 5 * 5}, (resumed[0], fault)
    assert summary["steps_missing"] == [] and summary["loss_mismatch_steps"] == []
    assert summary["bit_identical"] and summary["final_step"] == summary["steps"], summary
    assert not list(Path("/dev/shm").glob(f"xscale-{snapshot_key(tmp_path / 'run' / 'checkpoints')}*"))


@pytest.mark.slow
def test_a_warm_restart_forks_from_the_preloaded_server_and_ends_bit_identical(tmp_path):
    """xscale chaos --warm: torchrun restarts the group after a SIGKILLed worker by forking both workers from the
    server that imported torch and the training command once (xscale.launcher.torchrun --warm); the run ends
    bit-identical to the fault-free run."""
    report = run_soak(SoakOptions(output_dir=tmp_path, overrides=TINY, faults=1, kinds=["kill_worker"], nproc=2,
                                  seed=0, warm=WARM_MODULES, timeout_s=300))
    summary, (fault,) = report["summary"], report["faults"]
    log = (tmp_path / "run" / "chaos" / "job.log").read_text()
    assert "of fn: run_script_path (start_method: forkserver)" in log  # torchrun's line on the killed worker
    assert fault["recovered"] and set(fault["parts"]) >= {"spawn", "imports", "build"}, fault
    assert summary["steps_missing"] == [] and summary["loss_mismatch_steps"] == []
    assert summary["bit_identical"] and summary["final_step"] == summary["steps"], summary
