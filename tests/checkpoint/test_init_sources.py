"""checkpoint.init_from sources: a registry by prefix that the layers reading foreign formats fill."""

import pytest
import torch

import xscale.interop.hf.load  # noqa: F401  (registers hf:)
from xscale.checkpoint import init_sources
from xscale.checkpoint.init_sources import fill_from_source, init_source_prefix, register_init_source
from xscale.checkpoint.integrity import CheckpointError
from xscale.config.schema import ModelConfig


def test_the_prefix_of_a_setting():
    assert init_source_prefix("none") is None
    assert init_source_prefix("hf:some/dir") == "hf"
    assert init_source_prefix("hf:C:/models/x") == "hf"


def test_a_registered_source_fills_the_state_with_its_location():
    seen = {}

    def fill(state, location, model):
        seen["location"], seen["d_model"] = location, model.d_model
        state["w"].fill_(3.0)

    register_init_source("test-fill", fill)
    state = {"w": torch.zeros(2)}
    fill_from_source("test-fill:a:b", state, ModelConfig(d_model=32))
    assert seen == {"location": "a:b", "d_model": 32}
    assert torch.equal(state["w"], torch.full((2,), 3.0))


def test_an_unregistered_prefix_is_refused_with_the_registered_ones():
    with pytest.raises(CheckpointError, match=r"no weight source 'nowhere:' is registered; registered: .*hf:"):
        fill_from_source("nowhere:x", {}, ModelConfig())


def test_interop_registers_hf():
    assert "hf" in init_sources._SOURCES
