"""train.objective=bart end to end: a tiny encoder-decoder's loss falls on a corpus of short sentences; the
pipeline (slow) gives the one-process losses; task data refused."""

import json
import random
from pathlib import Path

import pytest

from xscale.cli import main
from xscale.commands.parity import compare_layouts
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer

WORDS = "the a cat dog bird sat ran saw on under near mat tree house red big small".split()
BART = ["model.family=encoder_decoder", "train.objective=bart", "data.dataset=text", "model.vocab_size=320",
        "model.d_model=32", "model.n_layers=1", "model.n_decoder_layers=1", "model.n_heads=2",
        "model.position=learned", "model.max_seq_len=24", "train.seq_len=24", "train.global_batch_size=8",
        "train.warmup_steps=2", "train.lr=3e-3", "data.eval_fraction=0.0", "train.loggers=[jsonl]",
        "train.plot=false", "train.progress=false", "train.watchdog=false", "train.peak_flops=1e12"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Documents of 2-4 short sentences ending in '.', and a SentencePiece tokenizer trained on them once."""
    root = tmp_path_factory.mktemp("bart")
    rng = random.Random(0)
    documents = [" ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) + " ."
                          for _ in range(rng.randint(2, 4))) for _ in range(300)]
    (root / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    tokenizer = SentencePieceTokenizer.train(documents, 300, num_sentinels=0)
    return {"data": root / "corpus.txt", "tokenizer": tokenizer.save(root / "tok.model")}


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record["train/loss"] for record in records if "train/loss" in record]


def test_a_tiny_encoder_decoder_learns_to_denoise(corpus, tmp_path, one_thread):
    assert main(["train", *BART, f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
                 "train.steps=30", "train.log_every=1", f"train.output_dir={tmp_path}"]) == 0
    losses = _losses(tmp_path)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_bart_needs_text_and_an_encoder_decoder():
    with pytest.raises(ConfigError, match="train.objective=bart corrupts windows of text.*data.dataset=copy"):
        load_config_from_cli(None, ["model.family=encoder_decoder", "train.objective=bart", "data.dataset=copy"])
    with pytest.raises(ConfigError, match="train.objective=bart needs model.family=encoder_decoder"):
        load_config_from_cli(None, ["model.family=encoder", "train.objective=bart"])
    with pytest.raises(ConfigError, match=r"train.objective.options.mask_ratio=0.9 \(BART's masked fraction\)"):
        load_config_from_cli(None, ["model.family=encoder_decoder", "train.objective=bart",
                                    "train.objective.options={mask_ratio: 0.9}"])


def test_context_parallelism_matches_one_process(corpus, tmp_path):
    """cp=2, load balanced: both stacks' sequences (24 encoder and 24 decoder tokens) cut into the ranks' chunks,
    the cross-attention gathering the memory; the losses are one process's."""
    overrides = [*BART, f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
                 "model.dropout=0.1", "train.micro_batch_size=4"]
    reference, results = compare_layouts(None, overrides, ["cp=2,cp_load_balance=true"], 4, tmp_path)
    assert reference[-1] < reference[0], f"the reference run must train: {reference}"
    assert len(results[0].losses) == 4 and results[0].passed(1e-5), (reference, results[0])


@pytest.mark.slow
def test_bart_under_pipeline_parallelism_matches_one_process(corpus, tmp_path):
    """A pipeline of 2 stages (the memory crosses from the encoder's stage to the decoder's) with dropout, in
    microbatches; the model is span corruption's (its tp, ZeRO and pp cases are test_layouts.py's), only the batches
    differ, and they are the same samples on every rank."""
    overrides = [*BART, f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
                 "model.dropout=0.1", "train.micro_batch_size=4"]
    reference, results = compare_layouts(None, overrides, ["pp=2,microbatches=2"], 4, tmp_path)
    assert reference[-1] < reference[0], f"the reference run must train: {reference}"
    assert len(results[0].losses) == 4 and results[0].passed(1e-5), (reference, results[0])
