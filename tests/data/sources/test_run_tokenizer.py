"""The run's tokenizer (:mod:`xscale.data.sources.run_tokenizer`): data.tokenizer, or one trained on the corpus
and named after it; none for datasets with a built-in vocabulary."""

from __future__ import annotations

import pytest

from xscale.config.schema import ConfigError
from xscale.data import run_tokenizer_file, trained_tokenizer_name
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.sources.run_tokenizer import build_tokenizer, corpus_documents


@pytest.mark.parametrize("name", ["copy", "lra_listops", "images_shapes"])
def test_a_built_in_vocabulary_has_no_tokenizer_file(build_config, name):
    assert run_tokenizer_file(build_config(name)) is None


def test_the_run_reads_data_tokenizer(build_config, hf_tokenizer):
    config = build_config("text")
    assert run_tokenizer_file(config) == hf_tokenizer
    assert build_tokenizer(config).vocab_size == load_tokenizer(hf_tokenizer).vocab_size


def test_a_trained_tokenizer_is_named_after_its_corpus(build_config, corpus):
    config = build_config("text", "data.tokenizer_vocab_size=300")
    config.data.tokenizer = ""
    assert trained_tokenizer_name(config) == "text-300.model" and run_tokenizer_file(config) is None
    blended = build_config("stdlib_text", f"data.sources=[{{path: {corpus['indexed']}}}]")
    assert trained_tokenizer_name(blended).startswith("sources-")


def test_indexed_sources_alone_hold_no_text_to_train_on(build_config, corpus):
    config = build_config("stdlib_text", f"data.sources=[{{path: {corpus['indexed']}}}]")
    with pytest.raises(ConfigError, match="^data.sources are all indexed"):
        corpus_documents(config)
