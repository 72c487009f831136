"""Generated images (:mod:`xscale.data.sources.images`): of model.image_size, no vocabulary, data.dataset.options noise."""

from __future__ import annotations

import pytest

from xscale.config.schema import ConfigError
from xscale.data import build_datasets
from xscale.data.sources import SOURCES


def test_images_take_the_models_size_and_no_vocabulary(build_config):
    config = build_config("images_shapes", "data.dataset.options={noise: 0.0}")
    train, _, vocab_size = build_datasets(config)
    assert vocab_size == 0 and train[0]["pixels"].shape == (config.model.image_channels, config.model.image_size,
                                                            config.model.image_size)
    assert SOURCES.get("images_shapes").options == ("noise",)


def test_an_unknown_option_is_refused_naming_the_dataset(build_config):
    with pytest.raises(ConfigError, match=r"^data.dataset='images_shapes' \(data.dataset.options \{'blur': 1\}\): "
                                          r"data.dataset.options \['blur'\] are not options"):
        build_datasets(build_config("images_shapes", "data.dataset.options={blur: 1}"))
