"""The dataset registry (:mod:`xscale.data.sources.registry`): every dataset registered once, in the order the
config lists them; each registered source builds; an unknown name is refused naming the registered ones."""

from __future__ import annotations

import pytest
from torch.utils.data import Dataset

from xscale.config.schema import ConfigError
from xscale.data import DATASETS, TASKS, TEXT_DATASETS, build_datasets
from xscale.data.sources import SOURCES, DatasetSource
from xscale.data.sources.registry import DatasetRegistry, data_options, generated_splits

EVERY_DATASET = ("stdlib_text", "text", "indexed", "copy", "assoc_recall", "listops", "labeled", "lra_listops",
                 "lra_retrieval", "lra_pathfinder", "images_shapes")


def test_the_registry_lists_every_dataset_in_the_configs_order():
    assert SOURCES.names() == EVERY_DATASET


def test_datasets_is_the_registry():
    assert DATASETS == SOURCES.names()
    assert set(TEXT_DATASETS) | set(TASKS) <= set(DATASETS)


@pytest.mark.parametrize("name", EVERY_DATASET)
def test_each_source_says_what_it_is_and_which_options_it_reads(name):
    source = SOURCES.get(name)
    assert source.name == name and source.description and isinstance(source.options, tuple)
    assert source.tokenized == (name in (*TEXT_DATASETS, "labeled"))


@pytest.mark.parametrize("name", EVERY_DATASET)
def test_each_registered_source_builds(build_config, name):
    config = build_config(name)
    train, evaluation, vocab_size = build_datasets(config)
    assert isinstance(train, Dataset) and len(train) > 0 and isinstance(evaluation, Dataset)
    assert 0 <= vocab_size <= config.model.vocab_size
    assert set(train[0]) >= ({"pixels", "labels"} if name == "images_shapes" else {"input_ids", "labels"})


def test_an_unknown_dataset_is_refused_naming_the_registered_ones(build_config):
    config = build_config("copy")
    config.data.dataset = "shakespeare"
    with pytest.raises(ConfigError, match=f"^data.dataset='shakespeare' is not one of {', '.join(EVERY_DATASET)}$"):
        build_datasets(config)


def test_a_name_registered_twice_is_refused():
    registry = DatasetRegistry()
    source = DatasetSource("toy", lambda config, objective, label_names: None, (), "a toy", tokenized=False)
    registry.add(source)
    assert "toy" in registry and registry.get("toy") is source
    with pytest.raises(KeyError, match="dataset 'toy' is registered twice"):
        registry.add(source)


def test_an_option_the_source_does_not_read_is_refused(build_config):
    config = build_config("copy", "data.dataset.options={num_symbols: 8, width: 3}")
    with pytest.raises(ConfigError, match=r"data.dataset.options \['width'\] are not options of data.dataset='copy' with "
                                          "this objective; allowed: num_symbols, length"):
        data_options(config, SOURCES.get("copy").options)


def test_generated_splits_continue_the_global_index(build_config):
    train, evaluation = generated_splits(build_config("copy"), lambda count, first: (count, first))
    assert train == (16, 0) and evaluation == (4, 16)
    assert generated_splits(build_config("copy", "data.eval_fraction=0"), lambda count, first: count) == (16, None)
