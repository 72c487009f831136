"""Training data: tokenizer, token files, datasets over global sample indices, the resumable sampler."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

import xscale.data.checks  # noqa: F401  (the data layer's config checks register themselves)
from xscale.config.schema import Config, ConfigError, resolve_objective
from xscale.data.blend import BlendedDataset, HasSources, SourceTokenCounter
from xscale.data.corpus import stdlib_documents, text_documents
from xscale.data.datasets import (
    ArrayTokens,
    PackedTextDataset,
    TaskDataset,
    collate,
    text_objective,
    tokenize_documents,
)
from xscale.data.fixed_vocab import FixedVocab
from xscale.data.indexed import IndexedTokens
from xscale.data.labeled import (
    ClassificationDataset,
    encode_examples,
    label_vocabulary,
    read_labeled_examples,
)
from xscale.data.load_tokenizer import load_tokenizer, tokenizer_source_file
from xscale.data.lra import (
    LRA_TASKS,
    PAD_AS_CONTENT,
    GeneratedClassificationDataset,
    GeneratedImageDataset,
    ShapesTask,
)
from xscale.data.sampler import GlobalSampler, StreamSampler
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.data.sources import ResolvedSource, cached_tokens, resolve_sources, shared_cache_dir, source_kind
from xscale.data.tasks import AssociativeRecallTask, CopyTask, ListOpsTask
from xscale.data.tokenizer import Tokenizer

__all__ = ["build_datasets", "build_tokenizer", "collate", "GlobalSampler", "StreamSampler", "Tokenizer", "FixedVocab", "DATASETS",
           "HasSources", "SourceTokenCounter", "run_tokenizer_file"]

logger = logging.getLogger(__name__)

TASKS = {"copy": CopyTask, "assoc_recall": AssociativeRecallTask, "listops": ListOpsTask}
TEXT_DATASETS = ("stdlib_text", "text", "indexed")
IMAGE_DATASETS = ("images_shapes",)
DATASETS = TEXT_DATASETS + tuple(TASKS) + ("labeled",) + tuple(f"lra_{name}" for name in LRA_TASKS) + IMAGE_DATASETS
DEFAULT_TASK_SAMPLES = 100_000
_TASK_OPTIONS = {
    "copy": ("num_symbols", "length"),
    "assoc_recall": ("num_keys", "num_values", "pairs"),
    "listops": ("max_depth", "max_args", "min_length", "max_length"),
}
_TEXT_OPTIONS = {"clm": (), "mlm": ("mask_probability",), "span": ("noise_density", "mean_span_length"),
                 "bart": ("mask_ratio", "poisson_lambda")}


def build_datasets(config: Config, label_names: list[str] | None = None) -> tuple[Dataset, Dataset | None, int]:
    """(train dataset, eval dataset or None when data.eval_fraction is 0, vocabulary size the model needs).
    ``label_names``: a trained classifier's classes (None: the labels found in the data)."""
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    objective = resolve_objective(config)
    if data.dataset not in DATASETS:
        raise ConfigError(f"data.dataset='{data.dataset}' is not one of {', '.join(DATASETS)}")
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
    if data.dataset == "labeled":
        train, evaluation, vocab_size = _labeled_datasets(config, label_names)
    elif data.dataset.startswith("lra_"):
        train, evaluation, vocab_size = _lra_datasets(config)
    elif data.dataset in IMAGE_DATASETS:
        train, evaluation, vocab_size = _image_datasets(config)
    elif data.dataset in TASKS:
        train, evaluation, vocab_size = _task_datasets(config, objective)
    elif data.sources:
        train, evaluation, vocab_size = _blended_datasets(config, objective, seq_len, seed)
    else:
        train, evaluation, vocab_size = _text_datasets(config, objective, seq_len, seed)
    if config.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the vocabulary of the data "
                          f"({vocab_size} tokens); set model.vocab_size={vocab_size} (or more)")
    return train, evaluation, vocab_size


def _options(config: Config, allowed: tuple[str, ...]) -> dict:
    unknown = sorted(set(config.data.options) - set(allowed))
    if unknown:
        raise ConfigError(f"data.options {unknown} are not options of data.dataset='{config.data.dataset}' with this "
                          f"objective; allowed: {', '.join(allowed) or 'none'}")
    return dict(config.data.options)


def _task_datasets(config: Config, objective: str) -> tuple[Dataset, Dataset | None, int]:
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    options = _options(config, _TASK_OPTIONS[data.dataset])
    try:
        task = TASKS[data.dataset](seq_len, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}': {error}") from error
    num_samples = data.num_samples or DEFAULT_TASK_SAMPLES
    train = TaskDataset(task, objective, seq_len, seed, num_samples)
    eval_samples = round(num_samples * data.eval_fraction)
    # Eval examples continue the global index past the training ones: disjoint random streams.
    evaluation = (TaskDataset(task, objective, seq_len, seed, eval_samples, first_sample=num_samples)
                  if eval_samples else None)
    return train, evaluation, task.vocab.vocab_size


def _labeled_datasets(config: Config, label_names: list[str] | None) -> tuple[Dataset, Dataset | None, int]:
    """Classification examples of data.path, the last data.eval_fraction of them held out for evaluation."""
    data = config.data
    if not data.path:
        raise ConfigError("data.dataset=labeled needs data.path: a .jsonl ({\"text\": ..., \"label\": ...} per line) "
                          "or .tsv (label<TAB>text per line) file")
    _options(config, ())
    with _user_file("data.path"):
        examples = read_labeled_examples(data.path, data.text_field, data.label_field)
    names = label_names or label_vocabulary([label for _, label in examples])
    if len(names) < 2:
        raise ConfigError(f"data.path={data.path} holds one label ({names[0]}); classification needs at least two")
    tokenizer = build_tokenizer(config, [text for text, _ in examples])
    class_token = tokenizer.bos_id if config.model.pooling == "cls" else None
    if config.model.pooling == "cls" and class_token is None:
        raise ConfigError("model.pooling=cls prepends the tokenizer's <s> as the class token, but data.tokenizer has "
                          "none; use model.pooling=mean or a tokenizer with a bos token")
    with _user_file("data.path"):
        token_ids, classes = encode_examples(examples, tokenizer, names, class_token)
    held_out = round(len(examples) * data.eval_fraction)
    if len(examples) - held_out < 1:
        raise ConfigError(f"data.path={data.path} holds {len(examples)} examples, none left to train on after "
                          f"data.eval_fraction={data.eval_fraction}")
    kept = len(examples) - held_out
    pad_id, seq_len = tokenizer.pad_id, config.train.seq_len
    train = ClassificationDataset(token_ids[:kept], classes[:kept], seq_len, pad_id, names)
    evaluation = (ClassificationDataset(token_ids[kept:], classes[kept:], seq_len, pad_id, names)
                  if held_out else None)
    return train, evaluation, tokenizer.vocab_size


def _lra_datasets(config: Config) -> tuple[Dataset, Dataset | None, int]:
    """An LRA-style task (:mod:`xscale.data.lra`) for train.task=classify; data.options go to its generator."""
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    cls = config.model.pooling == "cls"
    options = dict(data.options)
    pad_as_content = options.pop(PAD_AS_CONTENT, False)
    if not isinstance(pad_as_content, bool):
        raise ConfigError(f"data.options.{PAD_AS_CONTENT} must be true or false, got {pad_as_content!r}")
    try:  # the generator writes seq_len - 1 tokens when the class token leads them
        task = LRA_TASKS[data.dataset.removeprefix("lra_")](seq_len - cls, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}' (data.options {data.options}): {error}") from error
    class_token = task.vocab.bos_id if cls else None
    num_samples = data.num_samples or DEFAULT_TASK_SAMPLES
    train = GeneratedClassificationDataset(task, seq_len, seed, num_samples, class_token=class_token,
                                           pad_as_content=pad_as_content)
    eval_samples = round(num_samples * data.eval_fraction)
    evaluation = (GeneratedClassificationDataset(task, seq_len, seed, eval_samples, first_sample=num_samples,
                                                 class_token=class_token, pad_as_content=pad_as_content)
                  if eval_samples else None)
    return train, evaluation, task.vocab.vocab_size


def _image_datasets(config: Config) -> tuple[Dataset, Dataset | None, int]:
    """data.dataset=images_shapes (:mod:`xscale.data.lra.shapes`), images of model.image_size and image_channels;
    data.options: ``noise`` (the pixel noise's standard deviation). No vocabulary: 0."""
    data, model = config.data, config.model
    try:
        task = ShapesTask(model.image_size, model.image_channels, **_options(config, ("noise",)))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"data.dataset='{data.dataset}' (data.options {data.options}): {error}") from error
    num_samples = data.num_samples or DEFAULT_TASK_SAMPLES
    train = GeneratedImageDataset(task, config.train.seed, num_samples)
    eval_samples = round(num_samples * data.eval_fraction)
    evaluation = (GeneratedImageDataset(task, config.train.seed, eval_samples, first_sample=num_samples)
                  if eval_samples else None)
    return train, evaluation, 0


def trained_tokenizer_name(config: Config) -> str:
    """The file name, under ``<output_dir>/tokenizer/``, of the SentencePiece model trained on the run's corpus."""
    corpus = "sources" if config.data.sources else config.data.dataset
    return f"{corpus}-{config.data.tokenizer_vocab_size}.model"


def _trained_tokenizer_file(config: Config) -> Path:
    return Path(config.train.output_dir) / "tokenizer" / trained_tokenizer_name(config)


def run_tokenizer_file(config: Config) -> Path | None:
    """The file of the tokenizer this run uses (``data.tokenizer``, or the one trained on its corpus once it
    exists); None for the synthetic tasks, whose vocabulary is built in."""
    if config.data.dataset in (*TASKS, *IMAGE_DATASETS) or config.data.dataset.startswith("lra_"):
        return None
    if config.data.tokenizer:
        return tokenizer_source_file(config.data.tokenizer)
    trained = _trained_tokenizer_file(config)
    return trained if trained.is_file() else None


def build_tokenizer(config: Config, documents: list[str] | None = None) -> Tokenizer:
    """``data.tokenizer`` if set (kind by path: :mod:`xscale.data.load_tokenizer`); otherwise a SentencePiece model
    trained on the run's corpus (``documents`` if given, else read again), cached under <output_dir>/tokenizer/."""
    data = config.data
    if data.tokenizer:
        with _user_file("data.tokenizer"):
            return load_tokenizer(data.tokenizer)
    if data.dataset == "indexed" and not data.sources:
        raise ConfigError("data.dataset='indexed' holds tokens already: set data.tokenizer to the tokenizer file "
                          "they were made with")
    cache = _trained_tokenizer_file(config)
    if cache.is_file():
        return SentencePieceTokenizer.load(cache)
    logger.info("training a %d-token SentencePiece model on %s -> %s", data.tokenizer_vocab_size, data.dataset, cache)
    try:
        tokenizer = SentencePieceTokenizer.train(documents if documents is not None else _documents(config),
                                                 data.tokenizer_vocab_size)
    except ValueError as error:
        raise ConfigError(f"data.tokenizer_vocab_size: {error}") from error
    tokenizer.save(cache)
    return tokenizer


@contextlib.contextmanager
def _user_file(key: str) -> Iterator[None]:
    """A missing, unreadable or corrupt file a config key names, as one ConfigError naming the key."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as error:
        raise ConfigError(f"{key}: {error}") from error


def _documents(config: Config):
    data = config.data
    if data.sources:
        kinds = [source_kind(source, f"data.sources[{i}]") for i, source in enumerate(data.sources)]
        text = [(source, kind) for source, kind in zip(data.sources, kinds) if kind != "indexed"]
        if not text:
            raise ConfigError("data.sources are all indexed (token files): set data.tokenizer to the tokenizer file "
                              "they were made with")
        return itertools.chain.from_iterable(text_documents(source.path, data.text_field, jsonl=kind == "jsonl")
                                             for source, kind in text)
    if data.dataset == "stdlib_text":
        return stdlib_documents()
    if not data.path:
        raise ConfigError("data.dataset='text' needs data.path: a .txt/.jsonl file or a folder of them")
    return text_documents(data.path, data.text_field)


def _text_datasets(config: Config, objective: str, seq_len: int, seed: int) -> tuple[Dataset, Dataset | None, int]:
    data = config.data
    options = _options(config, _TEXT_OPTIONS[objective])
    if data.dataset == "indexed":
        if not data.path:
            raise ConfigError("data.dataset='indexed' needs data.path: the .bin/.idx prefix")
        with _user_file("data.path"):
            stream = IndexedTokens(data.path)
        tokenizer = build_tokenizer(config) if data.tokenizer or objective != "clm" else None
        with _user_file("data.path"):
            vocab_size = max(stream.max_token(tokenizer.vocab_size if tokenizer else None) + 1,
                             tokenizer.vocab_size if tokenizer else 0)
    elif data.dataset == "text":
        if not data.path:
            raise ConfigError("data.dataset='text' needs data.path: a .txt/.jsonl file or a folder of them")
        with _user_file("data.path"):
            if next(iter(_documents(config)), None) is None:
                raise ConfigError(f"data.path={data.path} holds no text (empty or blank files); point data.path at "
                                  "a .txt/.jsonl file or folder with text")
            tokenizer = build_tokenizer(config)  # trained on the documents as a stream when data.tokenizer is unset
            # Tokenized once into the run's data cache (as data.sources are), read memory-mapped from there.
            kind = "jsonl" if Path(data.path).suffix == ".jsonl" else "text"
            prefix = cached_tokens(data.path, kind, Path(data.path.rstrip("/")).name.split(".")[0] or "text",
                                   tokenizer.path, data.text_field, shared_cache_dir(config.train.output_dir),
                                   "data.path", path_key="data.path")
            stream = IndexedTokens(prefix)
        vocab_size = tokenizer.vocab_size
    else:  # the built-in corpus (Python's own documentation, a few MB): tokenized in memory
        documents = list(_documents(config))
        tokenizer = build_tokenizer(config, documents)
        stream = ArrayTokens(tokenize_documents(documents, tokenizer))
        vocab_size = tokenizer.vocab_size
    window, transform = text_objective(objective, tokenizer, seq_len, options)
    windows = PackedTextDataset.count_windows(len(stream), window, seq_len)
    eval_windows = round(windows * data.eval_fraction)
    if windows - eval_windows < 1:
        raise ConfigError(f"the corpus holds {len(stream)} tokens, {windows} windows of {window}: too few to train; "
                          "use more text or a shorter train.seq_len")
    train = PackedTextDataset(stream, window, transform, seed, stride=seq_len, num_windows=windows - eval_windows)
    evaluation = (PackedTextDataset(stream, window, transform, seed, stride=seq_len,
                                    first_window=windows - eval_windows, num_windows=eval_windows)
                  if eval_windows else None)
    return train, evaluation, vocab_size


def _blended_datasets(config: Config, objective: str, seq_len: int, seed: int
                      ) -> tuple[Dataset, Dataset | None, int]:
    """``data.sources`` blended by weight; evaluation on ``data.eval_sources`` (blended the same way) or, without
    them, on the last ``data.eval_fraction`` of each source's windows."""
    data = config.data
    options = _options(config, _TEXT_OPTIONS[objective])
    needs_tokenizer = data.tokenizer or objective != "clm" or any(
        source_kind(source, f"data.sources[{i}]") != "indexed" for i, source in enumerate(data.sources))
    tokenizer = build_tokenizer(config) if needs_tokenizer else None
    tokenizer_file = tokenizer.path if tokenizer is not None else None
    cache = shared_cache_dir(config.train.output_dir)
    train_sources = resolve_sources(data.sources, "sources", tokenizer_file, data.text_field, cache)
    eval_sources = resolve_sources(data.eval_sources, "eval_sources", tokenizer_file, data.text_field, cache)
    window, transform = text_objective(objective, tokenizer, seq_len, options)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
    parts = []
    for index, source in enumerate(train_sources + eval_sources):
        with _user_file(source.where):
            stream = IndexedTokens(source.prefix)
            vocab_size = max(vocab_size, stream.max_token(tokenizer.vocab_size if tokenizer else None) + 1)
        windows = PackedTextDataset.count_windows(len(stream), window, seq_len)
        held_out = 0 if data.eval_sources else round(windows * data.eval_fraction)
        if windows - held_out < 1:
            raise ConfigError(f"{source.where}: {len(stream)} tokens hold {windows} windows of {window}, too few to "
                              "train; use more text or a shorter train.seq_len")
        source_seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
        parts.append((PackedTextDataset(stream, window, transform, source_seed, stride=seq_len,
                                        num_windows=windows - held_out),
                      PackedTextDataset(stream, window, transform, source_seed, stride=seq_len,
                                        first_window=windows - held_out, num_windows=held_out) if held_out else None))
    train_parts = [train for train, _ in parts[:len(train_sources)]]
    train = _blend(train_parts, train_sources, data.num_samples)
    if data.eval_sources:
        evaluation = _blend([whole for whole, _ in parts[len(train_sources):]], eval_sources, 0)
    else:  # the sources with held-out windows (eval_fraction 0, or sources too small to spare one: none)
        held = [(held, source) for (_, held), source in zip(parts, train_sources) if held is not None]
        evaluation = _blend([part for part, _ in held], [source for _, source in held], 0) if held else None
    return train, evaluation, vocab_size


def _blend(datasets: list[Dataset], sources: list[ResolvedSource], size: int) -> BlendedDataset:
    """A blend of ``size`` samples (0: as many as the sources hold together)."""
    return BlendedDataset(datasets, [source.weight for source in sources], [source.name for source in sources],
                          size or sum(len(dataset) for dataset in datasets))
