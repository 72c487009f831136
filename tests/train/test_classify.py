"""train.task=classify end to end: a tiny encoder learns a separable task above chance, the checkpoint carries its
labels, ``xscale eval`` reports accuracy, a bad label file is one line and exit 2, and data parallelism (slow)
matches one process."""

import json
import random
from pathlib import Path

import pytest

from xscale.cli import main
from xscale.commands.parity import compare_layouts
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.train import metrics

POSITIVE, NEGATIVE = ["good", "great", "fine", "nice"], ["bad", "awful", "poor", "sad"]
FILLER = ["the", "movie", "was", "very", "a", "plot", "and", "it"]
TINY = ["model.family=encoder", "train.task=classify", "data.dataset=labeled", "model.vocab_size=512",
        "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16", "model.position=learned",
        "train.seq_len=12", "train.global_batch_size=16", "train.warmup_steps=2", "train.lr=1e-2",
        "data.eval_fraction=0.25", "train.loggers=[jsonl]", "train.plot=false", "train.progress=false",
        "train.watchdog=false", "train.peak_flops=1e12"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Examples whose label is the sentiment word hidden among 1-9 filler words (variable lengths: padding), a
    tokenizer trained on them once, and a label file with a broken line."""
    root = tmp_path_factory.mktemp("classify")
    rng = random.Random(0)
    lines = []
    for _ in range(256):
        positive = rng.random() < 0.5
        words = [rng.choice(FILLER) for _ in range(rng.randint(1, 9))] + [rng.choice(POSITIVE if positive else NEGATIVE)]
        rng.shuffle(words)
        lines.append(json.dumps({"text": " ".join(words), "label": "pos" if positive else "neg"}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "broken.jsonl").write_text("\n".join(lines[:3] + ['{"text": "good"}']) + "\n")
    tokenizer = SentencePieceTokenizer.train([json.loads(line)["text"] for line in lines], 400)
    return {"data": root / "train.jsonl", "broken": root / "broken.jsonl", "tokenizer": tokenizer.save(root / "tok.model")}


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    assert main(["train", *TINY, f"data.path={files['data']}", f"data.tokenizer={files['tokenizer']}",
                 "train.steps=24", "train.eval_every=24", f"train.output_dir={run}"]) == 0
    return run


def test_a_tiny_classifier_learns_a_separable_task_above_chance(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    accuracy = [record["eval/accuracy"] for record in records if "eval/accuracy" in record]
    assert accuracy and accuracy[-1] >= 0.85, accuracy  # chance: about 0.5


def test_the_checkpoint_carries_the_label_vocabulary(trained):
    meta = json.loads((trained / "checkpoints" / "step_00000024" / "meta.json").read_text())
    assert meta["labels"] == ["neg", "pos"] and meta["config"]["model"]["num_classes"] == 2


def test_eval_reports_accuracy(trained, capsys):
    assert main(["eval", str(trained), "--batches", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "accuracy" in line and "over 32 examples in 2 batches" in line, line
    accuracy = float(line.split("accuracy ")[1].split("%")[0])
    assert accuracy >= 85, line


def test_a_bad_label_file_is_one_line_and_exit_2(files, tmp_path, capsys):
    code = main(["train", *TINY, f"data.path={files['broken']}", f"data.tokenizer={files['tokenizer']}",
                 "train.steps=1", f"train.output_dir={tmp_path}"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1, error
    assert "data.path" in error and "broken.jsonl:4 has no \"label\" field" in error, error


def test_num_classes_must_match_the_data(files, tmp_path, capsys):
    code = main(["train", *TINY, f"data.path={files['data']}", f"data.tokenizer={files['tokenizer']}",
                 "model.num_classes=3", "train.steps=1", f"train.output_dir={tmp_path}"])
    assert code == 2 and "model.num_classes=3 but the data holds 2 labels" in capsys.readouterr().err


@pytest.mark.slow
def test_data_parallel_classification_matches_one_process(files, tmp_path):
    """Two data-parallel ranks with ZeRO-3 and gradient accumulation (each microbatch padded differently) give
    the one-process losses."""
    overrides = [*TINY, f"data.path={files['data']}", f"data.tokenizer={files['tokenizer']}",
                 "train.micro_batch_size=4", "data.eval_fraction=0.0", "train.lr=3e-3", "train.warmup_steps=0"]
    reference, results = compare_layouts(None, overrides, ["dp_shard=2,zero_stage=3"], 5, tmp_path)
    assert reference[-1] < reference[0], f"the reference run must train: {reference}"
    assert len(results[0].losses) == 5 and results[0].passed(1e-5), (reference, results[0])


def test_a_default_classify_run_evaluates_and_plots_accuracy_per_example(files, tmp_path, monkeypatch):
    """The issue's case: the plot of a classification run said nats/token, showed no accuracy, and the default run
    evaluated nothing. Now: eval/accuracy every 10 steps unasked, and a loss panel in nats/example beside it."""
    figures = []
    draw = metrics.loss_figure
    monkeypatch.setattr(metrics, "loss_figure", lambda history, unit: figures.append(draw(history, unit)) or figures[-1])
    assert main(["train", *TINY, f"data.path={files['data']}", f"data.tokenizer={files['tokenizer']}",
                 "train.steps=20", "train.plot=true", f"train.output_dir={tmp_path}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "eval/accuracy" in record] == [10, 20]
    assert [axis.get_ylabel() for axis in figures[0].axes] == ["loss (nats/example)", "accuracy (%)"]
    assert (tmp_path / "loss_curve.png").is_file()
