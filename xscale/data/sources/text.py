"""Text corpora packed into windows for a pre-training objective: ``stdlib_text`` (Python's own documentation,
built in), ``text`` (a .txt/.jsonl file or folder) and ``indexed`` (a .bin/.idx token file). With ``data.sources``
set, any of them reads the blend of those corpora instead (:mod:`xscale.data.sources.blends`).

The last ``data.eval_fraction`` of the corpus's windows are held out for evaluation.
"""

from __future__ import annotations

from pathlib import Path

from xscale.config.schema import Config, ConfigError
from xscale.data.datasets import ArrayTokens, PackedTextDataset, tokenize_documents
from xscale.data.indexed import IndexedTokens
from xscale.data.objectives import build_objective
from xscale.data.sources.blends import blended_datasets
from xscale.data.sources.registry import Built, data_options, register, user_file
from xscale.data.sources.resolve import cached_tokens, shared_cache_dir
from xscale.data.sources.run_tokenizer import build_tokenizer, corpus_documents
from xscale.data.tokenizer import Tokenizer

# (token stream, tokenizer or None, vocabulary size)
Stream = tuple[ArrayTokens | IndexedTokens, Tokenizer | None, int]


def _stdlib_stream(config: Config, objective: str) -> Stream:
    """The built-in corpus (a few MB): tokenized in memory."""
    documents = list(corpus_documents(config))
    tokenizer = build_tokenizer(config, documents)
    return ArrayTokens(tokenize_documents(documents, tokenizer)), tokenizer, tokenizer.vocab_size


def _text_stream(config: Config, objective: str) -> Stream:
    """data.path tokenized once into the run's data cache (as data.sources are), read memory-mapped from there."""
    data = config.data
    if not data.path:
        raise ConfigError("data.dataset='text' needs data.path: a .txt/.jsonl file or a folder of them")
    with user_file("data.path"):
        if next(iter(corpus_documents(config)), None) is None:
            raise ConfigError(f"data.path={data.path} holds no text (empty or blank files); point data.path at "
                              "a .txt/.jsonl file or folder with text")
        tokenizer = build_tokenizer(config)  # trained on the documents as a stream when data.tokenizer is unset
        kind = "jsonl" if Path(data.path).suffix == ".jsonl" else "text"
        prefix = cached_tokens(data.path, kind, Path(data.path.rstrip("/")).name.split(".")[0] or "text",
                               tokenizer.path, data.text_field, shared_cache_dir(config.train.output_dir),
                               "data.path", path_key="data.path")
        stream = IndexedTokens(prefix)
    return stream, tokenizer, tokenizer.vocab_size


def _indexed_stream(config: Config, objective: str) -> Stream:
    """A token file read where it lies; its tokenizer is needed only to mask or corrupt (or when named)."""
    data = config.data
    if not data.path:
        raise ConfigError("data.dataset='indexed' needs data.path: the .bin/.idx prefix")
    with user_file("data.path"):
        stream = IndexedTokens(data.path)
    tokenizer = build_tokenizer(config) if data.tokenizer or objective != "clm" else None
    with user_file("data.path"):
        vocab_size = max(stream.max_token(tokenizer.vocab_size if tokenizer else None) + 1,
                         tokenizer.vocab_size if tokenizer else 0)
    return stream, tokenizer, vocab_size


STREAMS = {"stdlib_text": _stdlib_stream, "text": _text_stream, "indexed": _indexed_stream}


def text_datasets(config: Config, objective: str, label_names: list[str] | None) -> Built:
    """Windows of the corpus for ``objective``, or the blend of ``data.sources`` when they are set."""
    if config.data.sources:
        return blended_datasets(config, objective)
    data, seq_len = config.data, config.train.seq_len
    data_options(config, ())
    stream, tokenizer, vocab_size = STREAMS[data.dataset.kind](config, objective)
    transform = build_objective(config, tokenizer, stream)
    window = transform.window_length
    windows = PackedTextDataset.count_windows(len(stream), window, seq_len)
    eval_windows = round(windows * data.eval_fraction)
    if windows - eval_windows < 1:
        raise ConfigError(f"the corpus holds {len(stream)} tokens, {windows} windows of {window}: too few to train; "
                          "use more text or a shorter train.seq_len")
    seed = config.train.seed
    train = PackedTextDataset(stream, window, transform, seed, stride=seq_len, num_windows=windows - eval_windows)
    evaluation = (PackedTextDataset(stream, window, transform, seed, stride=seq_len,
                                    first_window=windows - eval_windows, num_windows=eval_windows)
                  if eval_windows else None)
    return train, evaluation, vocab_size


register("stdlib_text", text_datasets, (),
         "Python's own documentation (built in, a few MB), for a pre-training objective", text=True)
register("text", text_datasets, (),
         "data.path: a .txt/.jsonl file or folder, tokenized once into the run's data cache", text=True)
register("indexed", text_datasets, (),
         "data.path: the .bin/.idx prefix of a token file (xscale data preprocess), read memory-mapped", text=True)
TEXT_DATASETS = tuple(STREAMS)
