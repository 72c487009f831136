"""``model.vocab_size=0`` (the default): the vocabulary the data needs, padded to a multiple that keeps every
tensor-parallel shard of the embedding and the output projection the same size, and their GEMMs on tile-friendly
widths (Megatron-LM pads to 128 x tp the same way: ``make-vocab-size-divisible-by``). A value given is kept and
refused when smaller than the tokenizer's vocabulary.
"""

from __future__ import annotations

import dataclasses

from xscale.config.schema import Config, ConfigError, resolve_objective
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.sources import SOURCES
from xscale.data.sources.registry import user_file
from xscale.data.sources.run_tokenizer import trained_tokenizer_file

AUTO = 0
VOCAB_MULTIPLE = 128


def vocab_multiple(config: Config) -> int:
    """The padding unit: VOCAB_MULTIPLE rows on each tp rank (and on each pp rank that holds a vocabulary stage)."""
    parallel = config.parallel
    return VOCAB_MULTIPLE * parallel.tp * (parallel.pp if parallel.pp_vocab_parallel else 1)


def padded_vocab_size(needed: int, multiple: int) -> int:
    """``needed`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(1, -(-needed // multiple)) * multiple


def resolve_vocab_size(config: Config, needed: int) -> str | None:
    """Set an automatic ``model.vocab_size`` (in place) to ``needed`` tokens padded, and return the line saying so;
    refuse a given one below ``needed``. None when the value was given."""
    model = config.model
    if model.vocab_size == AUTO:
        multiple = vocab_multiple(config)
        model.vocab_size = padded_vocab_size(needed, multiple)
        return (f"xscale: model.vocab_size={model.vocab_size}: the data's {needed} tokens padded to a multiple of "
                f"{multiple} ({VOCAB_MULTIPLE} x parallel.tp={config.parallel.tp}"
                + (f" x parallel.pp={config.parallel.pp}" if config.parallel.pp_vocab_parallel else "")
                + "); set model.vocab_size to pin it")
    if model.vocab_size < needed:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the vocabulary of the data "
                          f"({needed} tokens); set model.vocab_size={padded_vocab_size(needed, vocab_multiple(config))}"
                          f" (or at least {needed}), or 0 to take the tokenizer's")
    return None


def vocabulary_needed(config: Config) -> int:
    """The vocabulary the run's data needs, without tokenizing it: the tokenizer's (``data.tokenizer``, the one
    trained on the corpus, or ``data.tokenizer_vocab_size`` for the one still to be trained), or the dataset's
    built-in vocabulary (synthetic tasks; 0 for images)."""
    data = config.data
    if data.dataset.kind in SOURCES and not SOURCES.get(data.dataset.kind).tokenized and not data.sources:
        return SOURCES.get(data.dataset.kind).build(config, resolve_objective(config), None)[2]
    if data.tokenizer:
        with user_file("data.tokenizer"):
            return load_tokenizer(data.tokenizer).vocab_size
    trained = trained_tokenizer_file(config)
    return load_tokenizer(trained).vocab_size if trained.is_file() else data.tokenizer_vocab_size


def with_resolved_vocab(config: Config) -> Config:
    """A copy of ``config`` whose automatic ``model.vocab_size`` is resolved (:func:`vocabulary_needed`), for the
    commands that read the model before any data is built (``--print-config``, ``inspect``, ``plan``)."""
    if config.model.vocab_size != AUTO:
        return config
    resolved = dataclasses.replace(config, model=dataclasses.replace(config.model))
    resolve_vocab_size(resolved, vocabulary_needed(resolved))
    return resolved
