"""``xscale eval CHECKPOINT [section.key=value ...]``: loss and perplexity of a trained model, one line per source.

The data is the run's (its saved config), or what the overrides give (``data.dataset=text data.path=FILE``, ...).
A source is evaluated on the split ``data.eval_fraction`` sets aside; with ``data.eval_fraction=0``, on all of it.
The loss is the mean token cross-entropy over every labelled token read (the training objective's, without MoE
auxiliary losses); perplexity = exp(loss). One process; ``--batches N`` batches of ``train.global_batch_size``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from xscale.command_line import CommandParser
from xscale.config import Config, ConfigError
from xscale.data import TEXT_DATASETS, BlendedDataset, build_datasets, collate
from xscale.parallel.model import ParallelModel
from xscale.tools.trained import TrainedModel, load_trained_model, tokenizer_path
from xscale.train.checkpoint import CheckpointError
from xscale.train.step import evaluation_loss


@dataclass
class SourceResult:
    source: str
    split: str  # "eval" (data.eval_fraction's share) or "all" (data.eval_fraction=0)
    loss: float
    tokens: int
    batches: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def line(self) -> str:
        return (f"{self.source} ({self.split}): loss {self.loss:.4f}, perplexity {self.perplexity:.2f} "
                f"over {self.tokens} tokens in {self.batches} batches")


def evaluation_sources(config: Config) -> list[tuple[str, str, Dataset]]:
    """(source name, split, dataset) for every data source of the config: each member of a blend
    (``data.eval_sources``, or the held-out part of each of ``data.sources``) on its own, else the one dataset."""
    train, evaluation, _ = build_datasets(config)
    split = "eval"
    if evaluation is None or len(evaluation) == 0:
        evaluation, split = train, "all"
    if isinstance(evaluation, BlendedDataset):
        return [(name, split, dataset) for name, dataset in zip(evaluation.source_names, evaluation.datasets)]
    return [(config.data.path or config.data.dataset, split, evaluation)]


def evaluate_dataset(model: ParallelModel, dataset: Dataset, batch_size: int, batches: int) -> tuple[float, int, int]:
    """(mean token loss, labelled tokens, batches read) over the first ``batches`` batches of ``dataset``."""
    loss_sum, tokens, read = 0.0, 0, 0
    for start in range(0, min(len(dataset), batch_size * batches), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch = {key: value.to(model.device) for key, value in batch.items()}
        labelled = int((batch["labels"] != -100).sum())
        loss_sum += float(evaluation_loss(model, batch)) * labelled
        tokens, read = tokens + labelled, read + 1
    if tokens == 0:
        raise ConfigError("the evaluation data holds no labelled token; check data.* (or --batches)")
    return loss_sum / tokens, tokens, read


def evaluate(trained: TrainedModel, batches: int) -> list[SourceResult]:
    config = trained.config
    if config.data.dataset in TEXT_DATASETS and config.data.dataset != "indexed" and not config.data.tokenizer:
        config.data.tokenizer = str(tokenizer_path(trained))  # the run's, never a new one trained here
    train = config.train
    model = ParallelModel([trained.model], micro_batch_size=train.micro_batch_size or train.global_batch_size,
                          autocast_dtype=torch.bfloat16 if train.precision == "bf16" else None)
    results = []
    for source, split, dataset in evaluation_sources(config):
        loss, tokens, read = evaluate_dataset(model, dataset, train.global_batch_size, batches)
        results.append(SourceResult(source, split, loss, tokens, read))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale eval", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run directory, a checkpoint root (its latest) or a step directory")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.dataset=text data.path=FILE")
    parser.add_argument("--batches", type=int, default=None, help="batches per source (default: train.eval_batches)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    if args.batches is not None and args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    try:
        trained = load_trained_model(args.checkpoint, args.overrides, device=args.device)
        results = evaluate(trained, args.batches or trained.config.train.eval_batches)
    except (CheckpointError, ConfigError) as error:
        print(f"xscale eval: {' '.join(line.strip() for line in str(error).splitlines())}", file=sys.stderr)
        return 2
    print(f"step {trained.step} of {trained.step_dir}")
    for result in results:
        print(result.line())
    return 0
