"""The run's tokenizer: ``data.tokenizer``, or a SentencePiece model trained on the run's corpus and cached under
``<output_dir>/tokenizer/``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from pathlib import Path

from xscale.config.schema import Config, ConfigError
from xscale.data.corpus import stdlib_documents, text_documents
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.sources.registry import user_file
from xscale.data.sources.resolve import source_kind
from xscale.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def trained_tokenizer_name(config: Config) -> str:
    """The file name, under ``<output_dir>/tokenizer/``, of the SentencePiece model trained on the run's corpus."""
    corpus = "sources" if config.data.sources else config.data.dataset.kind
    return f"{corpus}-{config.data.tokenizer_vocab_size}.model"


def trained_tokenizer_file(config: Config) -> Path:
    return Path(config.train.output_dir) / "tokenizer" / trained_tokenizer_name(config)


def build_tokenizer(config: Config, documents: list[str] | None = None) -> Tokenizer:
    """``data.tokenizer`` if set (kind by path: :mod:`xscale.data.load_tokenizer`); otherwise a SentencePiece model
    trained on the run's corpus (``documents`` if given, else read again), cached under <output_dir>/tokenizer/."""
    data = config.data
    if data.tokenizer:
        with user_file("data.tokenizer"):
            return load_tokenizer(data.tokenizer)
    if data.dataset.kind == "indexed" and not data.sources:
        raise ConfigError("data.dataset='indexed' holds tokens already: set data.tokenizer to the tokenizer file "
                          "they were made with")
    cache = trained_tokenizer_file(config)
    if cache.is_file():
        return SentencePieceTokenizer.load(cache)
    logger.info("training a %d-token SentencePiece model on %s -> %s", data.tokenizer_vocab_size, data.dataset.kind, cache)
    try:
        tokenizer = SentencePieceTokenizer.train(documents if documents is not None else corpus_documents(config),
                                                 data.tokenizer_vocab_size)
    except ValueError as error:
        raise ConfigError(f"data.tokenizer_vocab_size: {error}") from error
    tokenizer.save(cache)
    return tokenizer


def corpus_documents(config: Config) -> Iterable[str]:
    """The run's text documents, as a stream: those of the text ``data.sources``, of the built-in corpus, or of
    ``data.path``."""
    data = config.data
    if data.sources:
        kinds = [source_kind(source, f"data.sources[{i}]") for i, source in enumerate(data.sources)]
        text = [(source, kind) for source, kind in zip(data.sources, kinds) if kind != "indexed"]
        if not text:
            raise ConfigError("data.sources are all indexed (token files): set data.tokenizer to the tokenizer file "
                              "they were made with")
        return itertools.chain.from_iterable(text_documents(source.path, data.text_field, jsonl=kind == "jsonl")
                                             for source, kind in text)
    if data.dataset.kind == "stdlib_text":
        return stdlib_documents()
    if not data.path:
        raise ConfigError("data.dataset='text' needs data.path: a .txt/.jsonl file or a folder of them")
    return text_documents(data.path, data.text_field)
