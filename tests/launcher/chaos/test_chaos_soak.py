"""The chaos soak end to end: 2 torchrun workers, every fault kind once, nothing lost, and the final model and
optimizer state bit-identical to a fault-free run of the same config."""

import pytest

from xscale.commands.chaos import TINY
from xscale.launcher.chaos.plan import KINDS
from xscale.launcher.chaos.soak import SoakOptions, run_soak


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
