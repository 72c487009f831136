"""``xscale train`` on Ctrl-C: the step ends, a checkpoint is saved, one line says how to resume, exit 130."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from xscale.commands.train import EXIT_INTERRUPTED, main, resume_command
from xscale.train.trainer import Trainer

TINY = [
    "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
    "train.global_batch_size=4", "train.seq_len=16", "train.log_every=1", "train.steps=100000",
    "train.tensorboard=false", "train.plot=false", "train.progress=false", "checkpoint.every=0",
    "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0",
]


def _interrupt_after_steps(metrics, steps: int) -> threading.Thread:
    """Ctrl-C (SIGINT to this process) once ``metrics`` holds ``steps`` steps."""

    def interrupt():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_saves_the_step_and_prints_how_to_resume(tmp_path, capsys):
    argv = [*TINY, f"train.output_dir={tmp_path}"]
    thread = _interrupt_after_steps(tmp_path / "metrics.jsonl", 2)
    code = main(argv)
    thread.join()
    out, err = capsys.readouterr()
    assert code == EXIT_INTERRUPTED, err
    (line,) = [line for line in out.splitlines() if line.startswith("interrupted")]
    step = int(line.split()[3].rstrip(";"))
    saved = tmp_path / "checkpoints" / f"step_{step:08d}"
    assert line == f"interrupted at step {step}; checkpoint saved to {saved}; resume with: {resume_command(argv, 'auto')}"
    assert (saved / "meta.json").is_file() and (tmp_path / "checkpoints" / "latest").read_text().strip() == saved.name
    assert "Traceback" not in err


def test_the_resume_command_drops_a_pinned_checkpoint(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert resume_command(["a.yaml", "checkpoint.resume=/x/step_1", "train.lr=0.1"], "/x/step_1") == \
        "xscale train a.yaml train.lr=0.1 checkpoint.resume=auto"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(["a b.yaml"], "auto") == "torchrun --nproc-per-node=2 --standalone -m xscale train 'a b.yaml'"


def test_a_lost_peer_is_one_line_and_exit_1_not_a_traceback(tmp_path, capsys, monkeypatch):
    def fit(self):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer")

    monkeypatch.setattr(Trainer, "fit", fit)
    assert main([*TINY, f"train.output_dir={tmp_path}"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("xscale train: rank 0 lost a peer (Read error")


def test_a_runtime_error_that_is_no_lost_peer_still_raises(tmp_path, monkeypatch):
    def fit(self):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(Trainer, "fit", fit)
    with pytest.raises(RuntimeError, match="shapes"):
        main([*TINY, f"train.output_dir={tmp_path}"])
