"""The synthetic tasks (:mod:`xscale.data.sources.synthetic`): data.dataset.options are the generator's keywords, a bad
value is refused naming the dataset, eval examples continue the global index."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import ConfigError
from xscale.data import build_datasets
from xscale.data.sources import SOURCES


def test_the_options_are_the_generators_keywords():
    assert SOURCES.get("copy").options == ("num_symbols", "length")
    assert SOURCES.get("assoc_recall").options == ("num_keys", "num_values", "pairs")
    assert SOURCES.get("listops").options == ("max_depth", "max_args", "min_length", "max_length")


def test_a_value_the_generator_refuses_names_the_dataset(build_config):
    with pytest.raises(ConfigError, match="^data.dataset='listops': listops: need 3 <= min_length"):
        build_datasets(build_config("listops", "data.dataset.options={min_length: 2}"))


def test_eval_examples_are_a_disjoint_stream(build_config):
    train, evaluation, vocab_size = build_datasets(build_config("copy"))
    assert len(train) == 16 and len(evaluation) == 4 and evaluation.first_sample == 16
    assert not torch.equal(train[0]["input_ids"], evaluation[0]["input_ids"])
    assert vocab_size == train.task.vocab.vocab_size
