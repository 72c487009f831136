"""A real torchrun job through launch/torchrun.sh (2 gloo workers): a worker that dies once is restarted with
``--max-restarts 1``, both workers resume from the latest checkpoint, and the loss curve continues exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.steps=8",
        "train.global_batch_size=4", "train.seq_len=16", "train.log_every=1", "train.tensorboard=false",
        "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0", "checkpoint.every=2"]
CRASH_STEP = 5  # rank 1 dies before step 5, once; step 4's checkpoint is the latest
# `xscale train`, except that rank 1 exits before step CRASH_STEP unless the marker file exists (it writes it), and
# starts 2 s late after a restart: rank 0 then reads the store first, where the dead attempt's keys are.
CRASH_ONCE = '''
import os, sys, time
from pathlib import Path
from xscale.cli import main
from xscale.train.trainer import Trainer

if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    time.sleep(2)

marker, crash_step, train_step = Path(os.environ["CRASH_MARKER"]), int(os.environ["CRASH_STEP"]), Trainer.train_step

def crash_once(self):
    if self.rank == 1 and self.step + 1 == crash_step and not marker.exists():
        marker.write_text("crashed")
        os._exit(17)
    return train_step(self)

Trainer.train_step = crash_once
sys.exit(main(["train", *sys.argv[1:]]))
'''


def run_job(tmp_path: Path, name: str, crash: bool) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """launch/torchrun.sh --max-restarts 1 on 2 processes; returns the result and the metrics records."""
    (tmp_path / "crash_once.py").write_text(CRASH_ONCE)
    marker, output = tmp_path / f"{name}.crashed", tmp_path / name
    if not crash:
        marker.write_text("no crash in this run")
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "CRASH_MARKER": str(marker), "CRASH_STEP": str(CRASH_STEP),
               "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "kernels")])}
    result = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "--nproc-per-node", "2",
                             "--max-restarts", "1", "--python", sys.executable, "--module", "crash_once", *TINY,
                             f"train.output_dir={output}"], env=environ, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)  # ~15 s when it works
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert marker.read_text() == ("crashed" if crash else "no crash in this run")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return result, records


@pytest.mark.slow
def test_a_crashed_worker_is_restarted_and_the_loss_curve_continues(tmp_path):
    restarted, records = run_job(tmp_path, "restarted", crash=True)
    assert "resumed from" in restarted.stdout and f"at step {CRASH_STEP - 1}" in restarted.stdout
    _, reference = run_job(tmp_path, "reference", crash=False)
    assert [record["step"] for record in records] == list(range(1, 9))  # 1-4, then 5-8 after the restart
    assert [record["train/loss"] for record in records] == [record["train/loss"] for record in reference]
