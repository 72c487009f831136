"""Labelled examples (:mod:`xscale.data.sources.labeled`): a file of at least two labels, the last examples held
out, its classes in label order."""

from __future__ import annotations

import pytest

from xscale.config.schema import ConfigError
from xscale.data import build_datasets


def test_labeled_needs_data_path(build_config):
    config = build_config("labeled")
    config.data.path = ""
    with pytest.raises(ConfigError, match="^data.dataset=labeled needs data.path"):
        build_datasets(config)


def test_one_label_is_refused(build_config, tmp_path):
    (tmp_path / "one.tsv").write_text("pos\tgood\npos\tfine\n")
    with pytest.raises(ConfigError, match="holds one label \\(pos\\); classification needs at least two"):
        build_datasets(build_config("labeled", f"data.path={tmp_path / 'one.tsv'}"))


def test_the_last_examples_are_held_out(build_config):
    train, evaluation, _ = build_datasets(build_config("labeled"))
    assert len(train) == 15 and len(evaluation) == 5 and train.label_names == ["0", "1"]
    assert build_datasets(build_config("labeled"), label_names=["0", "1", "2"])[0].label_names == ["0", "1", "2"]
