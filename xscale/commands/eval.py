"""``xscale eval CHECKPOINT [section.key=value ...]``: loss and perplexity of a trained model, one line per source.

The data is the run's (its saved config), or what the overrides give (``data.dataset=text data.path=FILE``, ...).
A source is evaluated on the split ``data.eval_fraction`` sets aside; with ``data.eval_fraction=0``, on all of it.
The loss is the mean token cross-entropy over every labelled token read (the training objective's, without MoE
auxiliary losses); perplexity = exp(loss). A classifier (train.task=classify) reports the mean example loss and the
accuracy, its labels mapped to classes as in training (the checkpoint's label list). One process; ``--batches N`` batches of ``train.global_batch_size``.
A model with a segment memory (``model.segment_memory``, Transformer-XL) also walks train.global_batch_size streams
of the split segment by segment (``--batches`` segments), carrying the memory, and reports that loss beside the
loss of the same windows without it.
An early-exit classifier (model.stack=early_exit) reports the accuracy at the exits and at full depth, the mean exit layer,
the share of the full depth's layer-rows computed (each example stopped at its exit), and the wall-clock of that
forward against the full-depth one on the same batches, measured here, as a ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.parser import CommandParser
from xscale.commands.trained import TrainedModel, load_trained_model, tokenizer_path
from xscale.config.schema import Config, ConfigError
from xscale.data import TEXT_DATASETS, BlendedDataset, PackedTextDataset, build_datasets, collate
from xscale.data.labeled import LABELS_META_KEY
from xscale.models.stacks import label_loss_positions
from xscale.parallel.loss import model_inputs
from xscale.parallel.model import ParallelModel
from xscale.runtime import StepContext
from xscale.train.recurrence import stream_evaluation
from xscale.train.step import evaluation_loss, evaluation_predictions, exit_path_refusal


@dataclass
class SourceResult:
    source: str
    split: str  # "eval" (data.eval_fraction's share) or "all" (data.eval_fraction=0)
    loss: float
    tokens: int
    batches: int
    accuracy: float | None = None  # a classifier's (then ``tokens`` counts examples); early exit: at the exits
    accuracy_full_depth: float | None = None  # early exit (model.stack=early_exit): every example read to the last layer
    mean_exit_layer: float | None = None  # early exit: the mean 1-based layer the examples leave at
    exit_compute_fraction: float | None = None  # early exit: layer-rows computed / layer-rows at full depth
    exit_timing: str | None = None  # early exit: the measured wall-clock ratio, or why every layer is computed
    streams: dict[str, float] | None = None  # model.segment_memory: eval/loss_memory and eval/loss_no_memory

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def line(self) -> str:
        if self.mean_exit_layer is not None:
            return (f"{self.source} ({self.split}): loss {self.loss:.4f}, accuracy {100 * self.accuracy:.2f}% "
                    f"(full depth {100 * self.accuracy_full_depth:.2f}%), mean exit layer "
                    f"{self.mean_exit_layer:.2f}, layer-rows computed {100 * self.exit_compute_fraction:.1f}% of "
                    f"full depth, over {self.tokens} examples in {self.batches} batches; {self.exit_timing}")
        if self.accuracy is not None:
            return (f"{self.source} ({self.split}): loss {self.loss:.4f}, accuracy {100 * self.accuracy:.2f}% "
                    f"over {self.tokens} examples in {self.batches} batches")
        line = (f"{self.source} ({self.split}): loss {self.loss:.4f}, perplexity {self.perplexity:.2f} "
                f"over {self.tokens} tokens in {self.batches} batches")
        if self.streams is not None:
            with_memory, without = self.streams["eval/loss_memory"], self.streams["eval/loss_no_memory"]
            line += (f"; streamed segment by segment: perplexity {_perplexity(with_memory):.2f} with the memory, "
                     f"{_perplexity(without):.2f} without (loss {with_memory:.4f} vs {without:.4f})")
        return line


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def evaluation_sources(config: Config, label_names: list[str] | None = None) -> list[tuple[str, str, Dataset]]:
    """(source name, split, dataset) for every data source of the config: each member of a blend
    (``data.eval_sources``, or the held-out part of each of ``data.sources``) on its own, else the one dataset."""
    train, evaluation, _ = build_datasets(config, label_names)
    split = "eval"
    if evaluation is None or len(evaluation) == 0:
        evaluation, split = train, "all"
    if isinstance(evaluation, BlendedDataset):
        return [(name, split, dataset) for name, dataset in zip(evaluation.source_names, evaluation.datasets)]
    return [(config.data.path or config.data.dataset.kind, split, evaluation)]


def evaluate_dataset(model: ParallelModel, dataset: Dataset, batch_size: int, batches: int, classify: bool = False,
                     exits: dict[str, float] | None = None) -> tuple[float, int, int, float | None]:
    """(mean token loss, labelled tokens, batches read, accuracy when ``classify``) over the first ``batches``
    batches of ``dataset``; ``exits``: a dict that receives an early-exit model's accuracy_full_depth,
    mean_exit_layer and exit_compute_fraction."""
    loss_sum, tokens, read = 0.0, 0, 0
    sums = dict.fromkeys(EXIT_METRICS, 0.0)
    for batch in _batches(model, dataset, batch_size, batches):
        labelled = int((batch["labels"] != -100).sum())
        loss_sum += float(evaluation_loss(model, batch)) * labelled
        if classify:
            for name, value in evaluation_predictions(model, batch, exits is not None).items():
                sums[name] += value * labelled
        tokens, read = tokens + labelled, read + 1
    if tokens == 0:
        raise ConfigError("the evaluation data holds no labelled token; check data.* (or --batches)")
    if exits is not None:
        exits.update({name: sums[name] / tokens for name in EXIT_METRICS[1:]})
    return loss_sum / tokens, tokens, read, sums["accuracy"] / tokens if classify else None


EXIT_METRICS = ("accuracy", "accuracy_full_depth", "mean_exit_layer", "exit_compute_fraction")


def _batches(model: ParallelModel, dataset: Dataset, batch_size: int, batches: int) -> Iterator[dict[str, torch.Tensor]]:
    """The first ``batches`` batches of ``dataset`` on the model's device."""
    for start in range(0, min(len(dataset), batch_size * batches), batch_size):
        yield _load(model, dataset, list(range(start, min(start + batch_size, len(dataset)))))


@torch.no_grad()
def time_exit_path(model: ParallelModel, dataset: Dataset, batch_size: int, batches: int) -> str:
    """The wall-clock of the forward that stops each example at its exit against the full-depth forward (every
    exit) on the same batches, both measured here (interleaved, after one untimed run of each), as a ratio; or why
    every layer is computed."""
    if reason := exit_path_refusal(model):
        return f"every layer computed: {reason}"
    network = model.model.eval()
    seconds = {True: 0.0, False: 0.0}
    loaded = list(_batches(model, dataset, batch_size, batches))
    for index, batch in enumerate([loaded[0], *loaded]):
        for exit_early in (True, False) if index % 2 else (False, True):  # alternate which runs first
            started = time.perf_counter()
            with model.autocast():
                network(model_inputs(batch), padding_mask=batch.get("padding_mask"), exit_early=exit_early)
            seconds[exit_early] += (time.perf_counter() - started) if index > 0 else 0.0
    return (f"wall-clock exit path {seconds[True]:.3f} s vs full depth {seconds[False]:.3f} s on the same "
            f"{len(loaded)} batches ({seconds[True] / max(seconds[False], 1e-9):.2f}x)")


def _load(model: ParallelModel, dataset: Dataset, rows: list[int]) -> dict[str, torch.Tensor]:
    batch = label_loss_positions(model.model.config, collate([dataset[i] for i in rows]))
    return {key: value.to(model.device) for key, value in batch.items()}


def evaluate(trained: TrainedModel, batches: int) -> list[SourceResult]:
    config = trained.config
    reads_text = config.data.dataset.kind in TEXT_DATASETS + ("labeled",) and config.data.dataset.kind != "indexed"
    if reads_text and not config.data.tokenizer:
        config.data.tokenizer = str(tokenizer_path(trained))  # the run's, never a new one trained here
    train = config.train
    model = ParallelModel([trained.model], micro_batch_size=train.micro_batch_size or train.global_batch_size,
                          autocast_dtype=torch.bfloat16 if train.low_precision else None)
    classify = train.task == "classify"
    label_names = trained.meta.get(LABELS_META_KEY) if classify else None
    results = []
    for source, split, dataset in evaluation_sources(config, label_names):
        exits = {} if classify and config.model.stack.kind == "early_exit" else None
        loss, tokens, read, accuracy = evaluate_dataset(model, dataset, train.global_batch_size, batches, classify,
                                                        exits)
        streams = None
        if config.model.segment_memory and isinstance(dataset, PackedTextDataset):
            streams = stream_evaluation(model, lambda rows, dataset=dataset: _load(model, dataset, rows), len(dataset),
                                        train.global_batch_size, batches, config.model.segment_memory, StepContext(),
                                        config.model.compressed_memory)
        if exits is not None:
            exits["exit_timing"] = time_exit_path(model, dataset, train.global_batch_size, batches)
        results.append(SourceResult(source, split, loss, tokens, read, accuracy, streams=streams, **(exits or {})))
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
