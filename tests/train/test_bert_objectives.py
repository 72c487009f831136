"""train.objective=spanbert, sop, nsp and electra end to end: a tiny encoder's loss (MLM plus the objective's
head) falls on a corpus of short sentences; ZeRO-3 over two data-parallel ranks gives the one-process losses (slow); the layouts
the heads cannot run under, and mismatched heads, are refused by name."""

import json
import random
from pathlib import Path

import pytest
import torch

from xscale.cli import main
from xscale.commands.parity import compare_layouts
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.data import build_datasets, collate
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.models import build_model
from xscale.parallel.loss import model_loss_sum

WORDS = "the a cat dog bird sat ran saw on under near mat tree house red big small".split()
HEADS = {"spanbert": "span_boundary", "sop": "sentence_pair", "nsp": "sentence_pair",
         "electra": "replaced_token_detection"}
ENCODER = ["model.family=encoder", "data.dataset=text", "model.vocab_size=320", "model.d_model=32",
           "model.n_layers=1", "model.n_heads=2", "model.position=learned", "model.max_seq_len=32",
           "train.seq_len=32", "train.global_batch_size=8", "train.warmup_steps=2", "train.lr=3e-3",
           "data.eval_fraction=0.0", "train.loggers=[jsonl]", "train.plot=false", "train.progress=false",
           "train.watchdog=false", "train.peak_flops=1e12"]


def objective(name: str) -> list[str]:
    return [*ENCODER, f"train.objective={name}", f"model.objective_head={HEADS[name]}"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Documents of 2-4 short sentences ending in '.', and a SentencePiece tokenizer trained on them once."""
    root = tmp_path_factory.mktemp("bert_objectives")
    rng = random.Random(0)
    documents = [" ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) + " ."
                          for _ in range(rng.randint(2, 4))) for _ in range(300)]
    (root / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    tokenizer = SentencePieceTokenizer.train(documents, 300, num_sentinels=0)
    return {"data": root / "corpus.txt", "tokenizer": tokenizer.save(root / "tok.model")}


def _batch_and_model(name: str, corpus: dict[str, Path]) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    config = load_config_from_cli(None, [*objective(name), f"data.path={corpus['data']}",
                                         f"data.tokenizer={corpus['tokenizer']}", "model.dropout=0.0",
                                         f"train.output_dir={corpus['data'].parent / name}"])
    train, _, _ = build_datasets(config)
    return collate([train[index] for index in range(8)]), build_model(config.model, seed=0)


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record["train/loss"] for record in records if "train/loss" in record]


@pytest.mark.parametrize("name", ["spanbert", "sop", "nsp", "electra"])
def test_a_tiny_encoder_learns(name, corpus, tmp_path, one_thread):
    assert main(["train", *objective(name), f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}",
                 "train.steps=30", "train.log_every=1", f"train.output_dir={tmp_path}"]) == 0
    losses = _losses(tmp_path)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize(("setting", "message"), [
    (["parallel.pp=2"], r"cannot run under parallel.pp=2: the head reads the last stage's states"),
    (["parallel.tp=2"], r"cannot run under parallel.tp=2: the head is not in the tensor-parallel plan"),
    (["parallel.cp=2"], r"cannot run under parallel.cp=2: a span's boundary tokens"),
    (["data.dataset=copy"], r"masks windows of text: set data.dataset=stdlib_text, text or indexed"),
    (["model.lm_head_transform=true"], r"set model.lm_head_transform=false"),
    (["train.task=classify", "model.num_classes=2", "data.dataset=labeled", "data.path=x.jsonl"],
     r"pre-trains with token losses: set train.task=lm"),
    (["train.objective.options={geometric_p: 1.5}"], r"train.objective.options.geometric_p=1.5 .* must be in \(0, 1\)"),
])
def test_layouts_and_settings_the_heads_cannot_take_are_refused(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*objective("spanbert"), *setting])


def test_the_objective_and_its_head_must_match():
    with pytest.raises(ConfigError, match="train.objective=electra trains model.objective_head=replaced_token_detection"):
        load_config_from_cli(None, [*ENCODER, "train.objective=electra"])
    with pytest.raises(ConfigError, match="generator_fraction=2.0 must be in"):
        load_config_from_cli(None, [*objective("electra"), "model.objective_head.options={generator_fraction: 2.0}"])
    with pytest.raises(ConfigError, match="train.objective=sop trains model.objective_head=sentence_pair, not "
                                          "span_boundary; set model.objective_head=sentence_pair"):
        load_config_from_cli(None, [*ENCODER, "train.objective=sop", "model.objective_head=span_boundary"])
    with pytest.raises(ConfigError, match="set train.objective to spanbert"):
        load_config_from_cli(None, [*ENCODER, "train.objective=mlm", "model.objective_head=span_boundary"])
    with pytest.raises(ConfigError, match="train.objective=nsp draws random second segments from one corpus"):
        load_config_from_cli(None, [*objective("nsp"), "data.sources=[{path: x, weight: 1}]"])


@pytest.mark.parametrize("name", ["spanbert", "nsp", "sop", "electra"])
def test_the_loss_sum_splits_over_rows(name, corpus):
    """What data parallelism and microbatches rely on: the summed loss of a batch is the sum over any split of its
    rows (every head reads its own rows only, the pair and RTD weights each row's own masked count)."""
    batch, model = _batch_and_model(name, corpus)
    halves = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(model_loss_sum(model, batch), sum(model_loss_sum(model, half) for half in halves),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sop", "electra"])
def test_zero3_over_two_ranks_matches_one_process(name, corpus, tmp_path):
    """dp_shard=2 with ZeRO-3: each rank half of every batch (its own masked spans, pairs or generator samples),
    the heads in FSDP's root unit (ELECTRA's generator reads it before the model's forward); the losses are one
    process's."""
    overrides = [*objective(name), f"data.path={corpus['data']}", f"data.tokenizer={corpus['tokenizer']}"]
    reference, results = compare_layouts(None, overrides, ["dp_shard=2,zero_stage=3"], 3, tmp_path)
    assert reference[-1] < reference[0], f"the reference run must train: {reference}"
    assert len(results[0].losses) == 3 and results[0].passed(1e-5), (reference, results[0])
