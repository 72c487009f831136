"""Sandwich Transformer orderings (Press et al. 2020): the stack's sub-layers run in the pattern's order."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.blocks.sandwich import SandwichOptions, sandwich_pattern


def _config(**options) -> ModelConfig:
    return ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, max_seq_len=8,
                       block=Component("sandwich", options))


def test_coefficient_k_gives_s_k_sf_n_minus_k_f_k() -> None:
    assert sandwich_pattern(SandwichOptions(coefficient=0), 3) == "sfsfsf"
    assert sandwich_pattern(SandwichOptions(coefficient=2), 3) == "sssfff"
    assert sandwich_pattern(SandwichOptions(pattern="ssffsf"), 3) == "ssffsf"


def test_blocks_split_the_pattern_two_sub_layers_each_with_the_standard_parameter_count() -> None:
    model = build_model(_config(coefficient=2), seed=0)
    assert [block.order for block in model.stack.layers.values()] == ["ss", "sf", "ff"]
    standard = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, max_seq_len=8), seed=0)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in standard.parameters())


def test_stack_output_and_gradients_match_the_pattern_run_by_hand() -> None:
    pattern = "ssffsf"
    model = build_model(_config(pattern=pattern), seed=0)
    stack, x = model.stack, torch.randn(2, 8, 16)
    residuals = [residual for block in stack.layers.values() for residual in block.sublayers]

    def by_hand(h: torch.Tensor) -> torch.Tensor:
        for kind, residual in zip(pattern, residuals):
            inner = residual.norm(h)
            h = h + (residual.sublayer(inner, stack.position) if kind == "s" else residual.sublayer(inner))
        return h

    def through_blocks(h: torch.Tensor) -> torch.Tensor:
        for block in stack.layers.values():
            h = block(h, stack.position)
        return h

    outputs, grads = [], []
    for run in (through_blocks, by_hand):
        model.zero_grad()
        out = run(x)
        out.pow(2).sum().backward()
        outputs.append(out)
        grads.append([p.grad.clone() for p in stack.layers.parameters()])
    torch.testing.assert_close(outputs[0], outputs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("options,message", [
    ({"pattern": "ssxfff"}, "may hold only 's'"),
    ({"pattern": "sssfffsf"}, "must have 3 's' and 3 'f'"),
    ({"pattern": "ssssff"}, "must have 3 's' and 3 'f'"),
    ({"coefficient": 4}, "coefficient=4 must be at most model.n_layers=3"),
])
def test_bad_patterns_are_refused_with_what_to_write(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model(_config(**options), seed=0)
