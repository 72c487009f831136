"""train.profile_start / train.profile_steps: a Chrome trace of the chosen steps, per rank."""

from __future__ import annotations

import json

from xscale.config.load import load_config
from xscale.train.trainer import Trainer

TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.global_batch_size=4",
        "train.seq_len=16", "train.steps=3", "train.log_every=100", "train.loggers=[]", "train.plot=false",
        "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy", "data.num_samples=64",
        "data.eval_fraction=0.0"]


def test_a_profiled_run_writes_a_chrome_trace_of_its_steps(tmp_path, capsys):
    Trainer(load_config(None, [*TINY, "train.profile_start=2", "train.profile_steps=1",
                               f"train.output_dir={tmp_path}"])).fit()
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    names = [event.get("name") for event in trace["traceEvents"]]
    assert "aten::mm" in names  # the step's matmuls
    assert names.count("Optimizer.step#AdamW.step") == 1  # one step's update: step 2 only
    assert "profile of steps 2-2 written" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "profile").iterdir()) == ["rank0.json"]  # no CUDA snapshot on CPU


def test_no_profile_unless_asked(tmp_path):
    Trainer(load_config(None, [*TINY, f"train.output_dir={tmp_path}"])).fit()
    assert not (tmp_path / "profile").exists()
