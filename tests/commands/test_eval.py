"""``xscale eval``: the mean token loss over the evaluation split equals the cross-entropy computed by hand."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.commands.conftest import TINY_RUN, WORDS
from xscale.cli import main
from xscale.commands.eval import evaluate
from xscale.commands.trained import load_trained_model, tokenizer_path
from xscale.data import build_datasets, collate

ROOT = Path(__file__).resolve().parents[2]
# The subprocesses import this checkout's xscale, wherever they run.
SUBPROCESS_ENV = {**os.environ,
                  "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])}


def _by_hand(trained, batches: int) -> float:
    config = trained.config
    config.data.tokenizer = str(tokenizer_path(trained))
    train, evaluation, _ = build_datasets(config)
    dataset = train if config.data.eval_fraction == 0 else evaluation
    size = config.train.global_batch_size
    batch = collate([dataset[i] for i in range(min(len(dataset), size * batches))])
    with torch.no_grad():
        logits = trained.model(batch["input_ids"])
    return float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100))


def _check_printed(output: str, trained_run) -> None:
    line = output.strip().splitlines()[-1]
    found = re.search(r"\(eval\): loss ([0-9.]+), perplexity ([0-9.]+) over (\d+) tokens in 3 batches", line)
    assert found, output
    loss, perplexity = float(found[1]), float(found[2])
    assert abs(loss - _by_hand(load_trained_model(trained_run), 3)) < 1e-3
    assert abs(perplexity - math.exp(loss)) < 0.01 * perplexity


def test_eval_prints_loss_and_perplexity_of_the_eval_split(trained_run, capsys):
    assert main(["eval", str(trained_run / "checkpoints"), "--batches", "3"]) == 0
    _check_printed(capsys.readouterr().out, trained_run)


@pytest.mark.slow
def test_eval_from_a_subprocess(trained_run):
    done = subprocess.run([sys.executable, "-m", "xscale", "eval", str(trained_run / "checkpoints"), "--batches", "3"],
                          capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    _check_printed(done.stdout, trained_run)


def test_other_data_by_overrides_and_the_whole_of_it_without_an_eval_split(trained_run, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("\n".join("alpha beta gamma delta " * 6 for _ in range(40)))
    trained = load_trained_model(trained_run, [f"data.path={other}", "data.eval_fraction=0"])
    result, = evaluate(trained, batches=2)
    assert result.source == str(other) and result.split == "all" and result.batches == 2
    assert abs(result.loss - _by_hand(load_trained_model(trained_run, [f"data.path={other}",
                                                                       "data.eval_fraction=0"]), 2)) < 1e-4


def test_bad_input_is_one_line_and_exit_2(tmp_path, trained_run, capsys):
    for arguments, expected in ((["eval", str(tmp_path / "nowhere")], "nowhere does not exist"),
                                (["eval", str(trained_run), "data.pth=x"], "unknown key 'data.pth'")):
        assert main(arguments) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_eval_of_a_recurrent_model_reports_perplexity_with_and_without_the_memory(tmp_path, capsys):
    """model.segment_memory: the split walked as streams, segment by segment, with the memory and without it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)) for i in range(300)))
    run = tmp_path / "run"
    recurrent = ["model.position=xl", "model.segment_memory=16", "data.order=streams", "train.steps=2"]
    assert main(["train", *TINY_RUN, *recurrent, f"data.path={corpus}", f"train.output_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--batches", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.search(r"perplexity ([0-9.]+) with the memory, ([0-9.]+) without \(loss ([0-9.]+) vs ([0-9.]+)\)", line)
    assert found, line
    assert float(found[1]) != float(found[2])
    assert abs(float(found[1]) - math.exp(float(found[3]))) < 0.01 * float(found[1])
