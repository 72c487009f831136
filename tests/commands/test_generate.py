"""``xscale generate`` on a trained checkpoint: from a subprocess as a user runs it, and its refusals (one line,
exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xscale.cli import main
from xscale.commands.trained import load_tokenizer, load_trained_model
from xscale.generation import generate

ROOT = Path(__file__).resolve().parents[2]
# The subprocesses import this checkout's xscale, wherever they run.
SUBPROCESS_ENV = {**os.environ,
                  "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])}


GREEDY_TOKENS = ["--tokens", "5,9,12,7", "--temperature", "0", "--max-new-tokens", "6"]


def _greedy_continuation(trained_run) -> list[int]:
    """What the command must print for GREEDY_TOKENS: the model's greedy tokens up to the tokenizer's eos."""
    trained = load_trained_model(trained_run)
    tokenizer = load_tokenizer(trained)
    tokens = generate(trained.model, torch.tensor([[5, 9, 12, 7]]), 6, eos_id=tokenizer.eos_id,
                      vocab_size=tokenizer.vocab_size).tokens[0].tolist()
    return tokens[:tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in tokens else tokens


def test_generate_prints_the_models_greedy_tokens(trained_run, capsys):
    assert main(["generate", str(trained_run / "checkpoints"), *GREEDY_TOKENS]) == 0
    printed = [int(token) for token in capsys.readouterr().out.strip().split(",")]
    assert printed == _greedy_continuation(trained_run)


@pytest.mark.slow
def test_generate_from_a_subprocess(trained_run):
    command = [sys.executable, "-m", "xscale", "generate", str(trained_run / "checkpoints"), *GREEDY_TOKENS]
    done = subprocess.run(command, capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [int(token) for token in done.stdout.strip().split(",")] == _greedy_continuation(trained_run)


def test_prompt_text_is_encoded_and_decoded_with_the_runs_tokenizer(trained_run, capsys):
    arguments = ["generate", str(trained_run), "--prompt", "alpha beta gamma", "--max-new-tokens", "8",
                 "--top-k", "20", "--top-p", "0.9", "--seed", "4"]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    assert main(arguments) == 0
    assert capsys.readouterr().out == first  # the seed fixes the text
    assert main([*arguments, "--no-cache"]) == 0
    assert capsys.readouterr().out == first  # the recompute path draws the same tokens


def _one_line_error(capsys, arguments) -> str:
    assert main(arguments) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line_and_exit_2(trained_run, tmp_path, capsys):
    missing = _one_line_error(capsys, ["generate", str(tmp_path / "nowhere"), "--tokens", "1,2"])
    assert "nowhere does not exist" in missing and "step directory" in missing
    checkpoints = str(trained_run / "checkpoints")
    assert "--tokens" in _one_line_error(capsys, ["generate", checkpoints, "--tokens", "1,x"])
    assert "--top-p" in _one_line_error(capsys, ["generate", checkpoints, "--tokens", "1", "--top-p", "2"])
    assert "model.vocab_size" in _one_line_error(capsys, ["generate", checkpoints, "--tokens", "600"])
    assert "max_seq_len=64" in _one_line_error(capsys, ["generate", checkpoints, "--tokens", "1",
                                                        "--max-new-tokens", "64"])
    assert "tokenizer" in _one_line_error(capsys, ["generate", checkpoints, "--prompt", "a",
                                                   "--tokenizer", str(tmp_path / "none.model")])


@pytest.mark.slow
def test_bad_input_from_a_subprocess(tmp_path):
    done = subprocess.run([sys.executable, "-m", "xscale", "generate", str(tmp_path / "missing"), "--prompt", "hi"],
                          capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "missing does not exist" in done.stderr
