"""The chaos soak's in-worker faults on one process: a NaN at one step stops the run before any checkpoint holds
it, a full disk during a save keeps the previous checkpoint, each fires once, and the start-up times are recorded."""

import pytest

from xscale.checkpoint.checkpointer import Checkpointer, CheckpointError
from xscale.config.load import load_config
from xscale.launcher.chaos.plan import ChaosFiles, Fault
from xscale.train.fault_injection import FaultInjectingTrainer
from xscale.train.trainer import NonFiniteTraining

TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
        "train.global_batch_size=4", "train.seq_len=16", "train.log_every=100", "train.tensorboard=false",
        "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0", "train.steps=6", "checkpoint.every=2"]


def _trainer(tmp_path, fault):
    files = ChaosFiles(tmp_path / "chaos")
    files.write_plan([fault])
    return FaultInjectingTrainer(load_config(None, [*TINY, f"train.output_dir={tmp_path}"]), files), files


@pytest.mark.parametrize("kind,error,match", [("nan", NonFiniteTraining, "step 3: loss nan"),
                                              ("disk_full", CheckpointError, "no space left on device while saving step 4")])
def test_a_fault_fires_once_and_the_run_resumes_from_the_checkpoint_before_it(tmp_path, one_thread, kind, error, match):
    fault = Fault(0, kind, step=3, rank=0)
    trainer, files = _trainer(tmp_path, fault)
    with pytest.raises(error, match=match):
        trainer.fit()
    assert files.fired_at(fault)["step"] == (3 if kind == "nan" else 4)  # disk_full: the first save at or after 3
    root = tmp_path / "checkpoints"
    assert Checkpointer(root).latest().name == "step_00000002" and not list(root.glob(".tmp-*"))

    resumed, _ = _trainer(tmp_path, fault)
    assert resumed.fit()["step"] == 6  # the fault does not fire again
    events = [event["event"] for event in files.read_events()]
    assert events == ["process", "start", "built", "resumed"] * 2
    assert [e["step"] for e in files.read_events() if e["event"] == "resumed"] == [0, 2]
