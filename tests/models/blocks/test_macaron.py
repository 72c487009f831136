"""Macaron blocks (Lu et al. 2019): x + 1/2 FFN_1, attention, x + 1/2 FFN_2, against a hand-written block."""

from __future__ import annotations

import torch

from tests.models.blocks.conftest import assert_matches_by_hand, tiny_model


def _by_hand(block, position, x: torch.Tensor) -> torch.Tensor:
    first, attention, second = block.feed_forward_first, block.attention, block.feed_forward
    x = x + 0.5 * first.sublayer(first.norm(x))
    x = x + attention.sublayer(attention.norm(x), position)
    return x + 0.5 * second.sublayer(second.norm(x))


def test_macaron_block_matches_the_hand_written_half_steps_outputs_and_gradients() -> None:
    model = tiny_model("macaron")
    block, position = model.stack.layers["1"], model.stack.position
    assert_matches_by_hand(block, lambda x: block(x, position), lambda x: _by_hand(block, position, x),
                           torch.randn(2, 8, 16))


def test_macaron_holds_two_ffns_and_keeps_the_standard_names() -> None:
    names = {name for name, _ in tiny_model("macaron").named_parameters()}
    standard = {name for name, _ in tiny_model().named_parameters()}
    assert standard < names
    assert {name for name in names - standard} == {name.replace("feed_forward.", "feed_forward_first.")
                                                    for name in standard if ".feed_forward." in name}
