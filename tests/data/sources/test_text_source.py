"""The text datasets (:mod:`xscale.data.sources.text`): windows of a corpus for an objective, the last
data.eval_fraction held out; a missing path or tokenizer refused naming the key; data.sources read as a blend."""

from __future__ import annotations

import pytest

from xscale.config.schema import ConfigError
from xscale.data import BlendedDataset, PackedTextDataset, build_datasets
from xscale.data.indexed import IndexedTokens


@pytest.mark.parametrize("name", ["text", "indexed"])
def test_a_file_dataset_needs_data_path(build_config, name):
    config = build_config(name)
    config.data.path = ""
    with pytest.raises(ConfigError, match=f"^data.dataset='{name}' needs data.path"):
        build_datasets(config)


def test_the_last_windows_are_held_out(build_config):
    train, evaluation, _ = build_datasets(build_config("text"))
    assert isinstance(train, PackedTextDataset) and isinstance(evaluation, PackedTextDataset)
    assert evaluation.first_window == len(train) and len(evaluation) == round((len(train) + len(evaluation)) / 4)


def test_an_indexed_corpus_for_clm_needs_no_tokenizer(build_config, corpus):
    config = build_config("indexed")
    config.data.tokenizer = ""
    _, _, vocab_size = build_datasets(config)
    assert vocab_size == IndexedTokens(str(corpus["indexed"])).max_token() + 1


def test_an_indexed_corpus_to_mask_needs_its_tokenizer(build_config):
    config = build_config("indexed", "model.family=encoder", "train.objective=mlm")
    config.data.tokenizer = ""
    with pytest.raises(ConfigError, match="^data.dataset='indexed' holds tokens already: set data.tokenizer"):
        build_datasets(config)


def test_a_corpus_too_small_for_one_window_is_refused(build_config):
    with pytest.raises(ConfigError, match="too few to train; use more text or a shorter train.seq_len"):
        build_datasets(build_config("text", "train.seq_len=4096", "model.max_seq_len=4096"))


def test_data_sources_are_read_as_a_blend(build_config, corpus):
    train, _, _ = build_datasets(build_config("stdlib_text", f"data.sources=[{{path: {corpus['indexed']}}}]"))
    assert isinstance(train, BlendedDataset) and train.source_names == ["docs"]
