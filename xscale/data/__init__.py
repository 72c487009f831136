"""Training data: tokenizer, token files, datasets over global sample indices, the resumable sampler.

``data.dataset`` names a registered source (:mod:`xscale.data.sources`), whose builder makes the run's datasets.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

import xscale.data.checks  # noqa: F401  (the data layer's config checks register themselves)
from xscale.config.schema import Config, ConfigError, resolve_objective
from xscale.data.blend import BlendedDataset, HasSources, SourceTokenCounter
from xscale.data.datasets import PackedTextDataset, collate
from xscale.data.fixed_vocab import FixedVocab
from xscale.data.load_tokenizer import tokenizer_source_file
from xscale.data.sampler import GlobalSampler, StreamSampler
from xscale.data.sources import DATASETS, SOURCES, TASKS, TEXT_DATASETS
from xscale.data.sources.run_tokenizer import build_tokenizer, trained_tokenizer_file, trained_tokenizer_name
from xscale.data.tokenizer import Tokenizer
from xscale.data.vocab_size import resolve_vocab_size, with_resolved_vocab

__all__ = ["build_datasets", "build_tokenizer", "collate", "GlobalSampler", "StreamSampler", "Tokenizer", "FixedVocab",
           "DATASETS", "TASKS", "TEXT_DATASETS", "BlendedDataset", "PackedTextDataset", "HasSources",
           "SourceTokenCounter", "run_tokenizer_file", "trained_tokenizer_name", "with_resolved_vocab"]


def build_datasets(config: Config, label_names: list[str] | None = None) -> tuple[Dataset, Dataset | None, int]:
    """(train dataset, eval dataset or None when data.eval_fraction is 0, vocabulary size the model needs).
    An automatic ``model.vocab_size`` (0) is set, in ``config``, to that size padded (:mod:`xscale.data.vocab_size`).
    ``label_names``: a trained classifier's classes (None: the labels found in the data)."""
    data = config.data
    objective = resolve_objective(config)
    source = SOURCES.get(data.dataset.kind)
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
    train, evaluation, vocab_size = source.build(config, objective, label_names)
    if (line := resolve_vocab_size(config, vocab_size)) and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return train, evaluation, vocab_size


def run_tokenizer_file(config: Config) -> Path | None:
    """The file of the tokenizer this run uses (``data.tokenizer``, or the one trained on its corpus once it
    exists); None for the synthetic tasks and images, whose vocabulary is built in."""
    if config.data.dataset.kind in SOURCES and not SOURCES.get(config.data.dataset.kind).tokenized:
        return None
    if config.data.tokenizer:
        return tokenizer_source_file(config.data.tokenizer)
    trained = trained_tokenizer_file(config)
    return trained if trained.is_file() else None
