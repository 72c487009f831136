"""The LRA-style tasks (:mod:`xscale.data.sources.lra`): data.dataset.options are the generator's keywords plus
pad_as_content; an unknown one is refused naming the dataset and its options."""

from __future__ import annotations

import pytest

from xscale.config.schema import ConfigError
from xscale.data import build_datasets
from xscale.data.sources import SOURCES


def test_the_options_are_the_generators_keywords_and_pad_as_content():
    assert SOURCES.get("lra_listops").options == ("max_depth", "max_args", "pad_as_content")
    assert SOURCES.get("lra_retrieval").options[-1] == "pad_as_content"


def test_an_option_the_generator_lacks_is_refused(build_config):
    with pytest.raises(ConfigError, match=r"^data.dataset='lra_pathfinder' \(data.dataset.options \{'width': 3\}\): .*width"):
        build_datasets(build_config("lra_pathfinder", "data.dataset.options={width: 3}"))


def test_pad_as_content_drops_the_padding_mask(build_config):
    train, _, _ = build_datasets(build_config("lra_listops", "data.dataset.options={max_depth: 3, pad_as_content: true}"))
    assert "padding_mask" not in train[0] and train.pad_as_content
