"""A position encoding's options live in its Options dataclass and are set as model.position.options.*: from YAML and
dotted overrides, refused by name when unknown or out of range, listed by xscale inspect --components."""

import pytest

import xscale.config.load as config_load
from xscale.cli import main
from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.models import build_model

SHAW = ["model.position=shaw", "model.attention.kind=dense", "model.d_model=32", "model.n_heads=2",
        "model.n_layers=1", "model.vocab_size=64", "model.max_seq_len=32"]


def test_shaw_s_max_distance_is_set_by_a_dotted_override():
    config = load_config(None, [*SHAW, "model.position.options.max_distance=4"])
    position = build_model(config.model).stack.position
    assert position.max_distance == 4 and position.key_table.shape[0] == 2 * 4 + 1


def test_and_from_yaml(tmp_path):
    path = tmp_path / "shaw.yaml"
    path.write_text("model:\n  position: {kind: shaw, options: {max_distance: 3}}\n  attention: {kind: dense}\n")
    assert load_config(path).model.position.options == {"max_distance": 3}


def test_the_default_kind_takes_an_option_alone():
    assert load_config(None, ["model.position.options.theta=500000"]).model.position.options == {"theta": 500000}


@pytest.mark.parametrize("overrides,message", [
    ([*SHAW, "model.position.options.max_dist=4"],
     r"unknown key 'model.position.options.max_dist' \(did you mean 'max_distance'\?\); valid keys: max_distance"),
    ([*SHAW, "model.position.options.max_distance=0"], "model.position.options.max_distance must be >= 1, got 0"),
    (["model.position=alibi", "model.position.options.theta=2"],
     "model.position: position 'alibi' takes no options; remove model.position.options.theta"),
    (["model.norm.options.eps=-1"], "model.norm.options.eps must be positive"),
    (["model.position=t5_bias", "model.position.options.num_buckets=2"], "t5_bias needs num_buckets >= 4"),
])
def test_a_bad_option_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_flat_key_of_the_previous_release_still_reads(capsys, monkeypatch):
    monkeypatch.setattr(config_load, "_ANNOUNCED", set())  # the line is printed once per process
    config = load_config(None, ["model.rope_theta=5000"])
    assert config.model.position.options == {"theta": 5000}
    assert capsys.readouterr().err.strip() == ("xscale: model.rope_theta is deprecated and will be removed in the next "
                                               "release; read as model.position.options.theta")


def test_inspect_lists_the_options_with_defaults_and_help(capsys):
    assert main(["inspect", "--components"]) == 0
    out = capsys.readouterr().out
    assert "model.position: shaw" in out and "max_distance=16 (k: relative distances are clipped" in out
    assert "model.norm: rmsnorm" in out and "eps=1e-05" in out
