"""``train.objective`` as a component (``{kind, options}``): a bare kind on the command line or in YAML, its options
checked against the kind's ``Options`` dataclass and read by the transform, ``auto`` taking the family's kind's
options, the options of the previous release (``data.dataset.options``) read as the new key with one line each, and
bad kinds and options refused by name in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import xscale.config.load as config_load
from xscale.config.load import config_to_yaml, load_config
from xscale.config.schema import Component, ConfigError
from xscale.data.objectives import (
    IGNORE_INDEX,
    OBJECTIVES,
    BartOptions,
    MaskingOptions,
    SpanBertOptions,
    SpanCorruptionOptions,
    build_objective,
    objective_options,
)
from xscale.models.registry import NoOptions

ENCODER = ["model.family=encoder", "model.position=learned"]
# A vocabulary of 32 tokens whose specials are 0..3 (pad, bos, eos, mask).
TOKENIZER = SimpleNamespace(vocab_size=32, mask_id=3, special_ids=[0, 1, 2, 3], pad_id=0, bos_id=1, eos_id=2)


def test_every_kind_is_registered_with_its_options():
    assert set(OBJECTIVES.names()) == {"auto", "clm", "mlm", "span", "bart", "spanbert", "nsp", "sop", "electra"}
    expected = {"mlm": MaskingOptions, "nsp": MaskingOptions, "sop": MaskingOptions, "electra": MaskingOptions,
                "span": SpanCorruptionOptions, "bart": BartOptions, "spanbert": SpanBertOptions}
    for kind in OBJECTIVES.names():  # auto and clm: none (auto takes its kind's)
        assert OBJECTIVES.options_class(kind) is expected.get(kind, NoOptions), kind


def test_a_bare_kind_and_the_component_read_alike(tmp_path):
    assert load_config(None, [*ENCODER, "train.objective=mlm"]).train.objective == Component("mlm")
    path = tmp_path / "spanbert.yaml"
    path.write_text("model: {family: encoder, position: learned, objective_head: span_boundary}\n"
                    "train:\n  objective: {kind: spanbert, options: {geometric_p: 0.3}}\n")
    config = load_config(path, ["train.objective.options.max_span_words=5"])
    assert config.train.objective == Component("spanbert", {"geometric_p": 0.3, "max_span_words": 5})
    assert objective_options(config) == SpanBertOptions(geometric_p=0.3, max_span_words=5)
    path.write_text("model: {family: encoder, position: learned}\ntrain: {objective: mlm}\n")
    config = load_config(path, ["train.objective.options.mask_probability=0.3"])
    assert config.train.objective == Component("mlm", {"mask_probability": 0.3})


def test_print_config_writes_the_component_and_reads_it_back(tmp_path):
    config = load_config(None, [*ENCODER, "train.objective=mlm", "train.objective.options.mask_probability=0.2"])
    printed = config_to_yaml(config)
    assert "  objective:\n    kind: mlm\n    options:\n      mask_probability: 0.2\n" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(tmp_path / "printed.yaml") == config


def test_auto_takes_the_options_of_the_familys_kind():
    config = load_config(None, [*ENCODER, "train.objective.options.mask_probability=0.25"])
    assert config.train.objective == Component("auto", {"mask_probability": 0.25})
    assert objective_options(config) == MaskingOptions(0.25)
    with pytest.raises(ConfigError, match="objective 'clm' takes no options; remove "
                                          "train.objective.options.mask_probability"):
        load_config(None, ["train.objective.options.mask_probability=0.25"])


def test_the_options_reach_the_samples():
    config = load_config(None, [*ENCODER, "train.objective=mlm", "train.objective.options.mask_probability=0.5",
                                "train.seq_len=40"])
    transform = build_objective(config, TOKENIZER)
    window = torch.arange(4, 44) % 28 + 4  # 40 ordinary tokens
    sample = transform(window, torch.Generator().manual_seed(0))
    assert transform.window_length == 40 and int((sample["labels"] != IGNORE_INDEX).sum()) == 20


@pytest.mark.parametrize("old, new, kind", [
    ("mask_probability: 0.2", {"mask_probability": 0.2}, "mlm"),
    ("geometric_p: 0.3, max_span_words: 6", {"geometric_p": 0.3, "max_span_words": 6}, "spanbert"),
])
def test_the_options_of_the_previous_release_still_read(old, new, kind, capsys, monkeypatch):
    monkeypatch.setattr(config_load, "_ANNOUNCED", set())  # the lines are printed once per process
    head = ["model.objective_head=span_boundary"] if kind == "spanbert" else []
    settings = [*ENCODER, *head, f"train.objective={kind}"]
    config = load_config(None, [*settings, f"data.dataset.options={{{old}}}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert config == load_config(None, [*settings, f"train.objective.options={{{old}}}"])
    assert config.train.objective == Component(kind, new) and config.data.dataset.options == {}
    assert lines == [f"xscale: data.dataset.options.{key} is deprecated and will be removed in the next release; "
                     f"read as train.objective.options.{key}" for key in new]


def test_a_new_key_set_beside_the_old_one_wins(capsys, monkeypatch):
    monkeypatch.setattr(config_load, "_ANNOUNCED", set())
    config = load_config(None, [*ENCODER, "data.dataset.options.mask_probability=0.2",
                                "train.objective.options.mask_probability=0.3"])
    assert config.train.objective == Component("auto", {"mask_probability": 0.3})


@pytest.mark.parametrize("overrides, message", [
    (["train.objective=mlmm"], r"train.objective='mlmm' is not a known objective \(did you mean 'mlm'\?\); "
                               "available: auto, bart"),
    (["train.objective=mlm", "train.objective.options.mask_prob=0.2"],
     r"unknown key 'train.objective.options.mask_prob' \(did you mean 'mask_probability'\?\)"),
    (["train.objective=mlm", "train.objective.options.mask_probability=0.7"],
     r"train.objective.options.mask_probability=0.7 \(the masked fraction\) must be in \(0, 0.5\]"),
    (["train.objective=mlm", "train.objective.options.mask_probability=lots"],
     "train.objective.options.mask_probability: expected a number"),
    (["model.family=encoder_decoder", "train.objective=span", "train.objective.options.noise_density=1.5"],
     r"train.objective.options.noise_density=1.5 \(the corrupted fraction\) must be in \(0, 1\)"),
    (["train.objective=mlm", "train.objective.options.mask_probability=0.2", "data.dataset=copy"],
     "train.objective.options apply to windows of text, but data.dataset=copy lays its examples out without them"),
    (["train.objective=electra", "model.objective_head=replaced_token_detection",
      "train.objective.options.discriminator_weight=20"],
     r"train.objective.options.discriminator_weight is not an option of train.objective=electra; set "
     r"model.objective_head.options.rtd_weight \(ELECTRA's lambda is the head's\)"),
    (["train.objective=electra", "model.objective_head=replaced_token_detection", "train.objective.options.rtd_weight=20"],
     "set model.objective_head.options.rtd_weight"),
])
def test_a_bad_objective_is_refused_by_name_in_one_line(overrides, message):
    settings = [] if overrides[0].startswith("model.family") else ENCODER
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, [*settings, *overrides])
    assert "\n" not in str(error.value)
