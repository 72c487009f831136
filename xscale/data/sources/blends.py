"""``data.sources`` blended by weight (:class:`xscale.data.blend.BlendedDataset`), read by the text datasets when
the sources are set; evaluation on ``data.eval_sources`` (blended the same way) or, without them, on the last
``data.eval_fraction`` of each source's windows."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from xscale.config.schema import Config, ConfigError
from xscale.data.blend import BlendedDataset
from xscale.data.datasets import PackedTextDataset
from xscale.data.indexed import IndexedTokens
from xscale.data.objectives import build_objective
from xscale.data.sources.registry import Built, data_options, user_file
from xscale.data.sources.resolve import ResolvedSource, resolve_sources, shared_cache_dir, source_kind
from xscale.data.sources.run_tokenizer import build_tokenizer


def blended_datasets(config: Config, objective: str) -> Built:
    """Train and eval blends of ``data.sources``; each source's windows sampled from its own seed."""
    data, seq_len, seed = config.data, config.train.seq_len, config.train.seed
    data_options(config, ())
    needs_tokenizer = data.tokenizer or objective != "clm" or any(
        source_kind(source, f"data.sources[{i}]") != "indexed" for i, source in enumerate(data.sources))
    tokenizer = build_tokenizer(config) if needs_tokenizer else None
    tokenizer_file = tokenizer.path if tokenizer is not None else None
    cache = shared_cache_dir(config.train.output_dir)
    train_sources = resolve_sources(data.sources, "sources", tokenizer_file, data.text_field, cache)
    eval_sources = resolve_sources(data.eval_sources, "eval_sources", tokenizer_file, data.text_field, cache)
    transform = build_objective(config, tokenizer)
    window = transform.window_length
    vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
    parts = []
    for index, source in enumerate(train_sources + eval_sources):
        with user_file(source.where):
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
