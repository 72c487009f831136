"""The ``xscale`` command: the built-in default run, inspect, and clear failures."""

import subprocess
import sys

from xscale.cli import main


def test_default_run_trains_checkpoints_and_plots(tmp_path, capsys):
    code = main(["train", "train.steps=3", "train.global_batch_size=4", "train.seq_len=32", "model.n_layers=1",
                 "train.log_every=1", f"train.output_dir={tmp_path}", "data.tokenizer_vocab_size=1000",
                 "model.vocab_size=1000"])
    assert code == 0
    out = capsys.readouterr().out
    assert "step 3/3" in out and "tok/s" in out and "MFU" in out
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (tmp_path / "tokenizer").is_dir()


def test_inspect_prints_parameters_flops_and_memory(capsys):
    assert main(["inspect", "configs/gpt2-small.yaml"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "FLOPs per token" in out and "optimizer" in out


def test_inspect_plans_a_pipeline_without_a_microbatch_count(capsys):
    """parallel.pp=2 alone: the microbatch count defaults to the fewest 1F1B runs (2), printed with its bubble."""
    tiny = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "train.seq_len=16",
            "train.global_batch_size=8"]
    assert main(["inspect", *tiny, "parallel.pp=2"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 2: pp=2" in out
    assert "pipeline: 1f1b, 2 stages (1 per rank), 2 microbatches per step (auto), bubble (p-1)/(m+p-1) = 0.333" in out
    assert main(["inspect", *tiny, "parallel.pp=2", "parallel.microbatches=4"]) == 0
    assert "4 microbatches per step, bubble (p-1)/(m+p-1) = 0.200" in capsys.readouterr().out
    assert main(["inspect", *tiny, "parallel.pp=2", "parallel.microbatches=1"]) == 2  # a set count is not changed
    assert "needs at least parallel.pp=2 microbatches, got parallel.microbatches=1" in capsys.readouterr().err


def test_bad_config_exits_2_with_the_reason(capsys):
    assert main(["train", "model.n_heads=7"]) == 2
    assert "does not divide model.d_model" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "xscale", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "inspect" in result.stdout
