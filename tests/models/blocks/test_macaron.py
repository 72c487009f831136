"""Macaron blocks (Lu et al. 2019): x + 1/2 FFN_1, attention, x + 1/2 FFN_2, against a hand-written block."""

from __future__ import annotations

import torch

from xscale.config.schema import ModelConfig
from xscale.models import build_model

MACARON = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, block="macaron")


def _by_hand(block, position, x: torch.Tensor) -> torch.Tensor:
    first, attention, second = block.feed_forward_first, block.attention, block.feed_forward
    x = x + 0.5 * first.sublayer(first.norm(x))
    x = x + attention.sublayer(attention.norm(x), position)
    return x + 0.5 * second.sublayer(second.norm(x))


def test_macaron_block_matches_the_hand_written_half_steps_outputs_and_gradients() -> None:
    model = build_model(MACARON, seed=0)
    block, position = model.stack.layers["1"], model.stack.position
    x = torch.randn(2, 8, 16, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_(True)
    out = block(x, position)
    torch.testing.assert_close(out, _by_hand(block, position, x))
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    _by_hand(block, position, reference_x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad)
    for name, p in block.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_macaron_holds_two_ffns_and_keeps_the_standard_names() -> None:
    names = {name for name, _ in build_model(MACARON, seed=0).named_parameters()}
    standard = {name for name, _ in build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
                                                            max_seq_len=8), seed=0).named_parameters()}
    assert standard < names
    assert {name for name in names - standard} == {name.replace("feed_forward.", "feed_forward_first.")
                                                    for name in standard if ".feed_forward." in name}
