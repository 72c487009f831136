"""The Evolved Transformer's searched cell (So et al. 2019) against its four residuals written out, the
convolutions as loops over tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.blocks.conftest import assert_matches_by_hand, tiny_model


def _model(family: str):
    return tiny_model("evolved", family=family, max_seq_len=12, position="rope")


def _convolution_by_hand(weight: torch.Tensor, x: torch.Tensor, causal: bool, depthwise: bool) -> torch.Tensor:
    """out[t, o] = sum_j sum_c W[o, c, j] x[t + j - p, c] (depthwise: c = o only); zero outside the sequence."""
    width, length = weight.shape[-1], x.shape[1]
    before = width - 1 if causal else (width - 1) // 2
    out = x.new_zeros(x.shape[0], length, weight.shape[0])
    for t in range(length):
        for j in range(width):
            source = t + j - before
            if 0 <= source < length:
                tap = weight[:, :, j]
                out[:, t] = out[:, t] + (x[:, source] * tap[:, 0] if depthwise else x[:, source] @ tap.T)
    return out


def _cell_by_hand(block, position, x: torch.Tensor, causal: bool) -> torch.Tensor:
    glu, conv = block.gated_linear.sublayer, block.convolutions.sublayer
    h = block.gated_linear.norm(x)
    x = x + glu.w_value(h) * torch.sigmoid(glu.w_gate(h))
    h = block.convolutions.norm(x)
    wide = torch.relu(conv.w_wide(h))
    narrow = torch.relu(_convolution_by_hand(conv.narrow_conv.weight, h, causal, depthwise=False))
    hidden = conv.hidden_norm(wide + F.pad(narrow, (0, 56)))
    out = conv.w_pointwise(_convolution_by_hand(conv.depthwise_conv.weight, hidden, causal, depthwise=True))
    x = x + F.pad(out, (0, 8))
    x = x + block.attention.sublayer(block.attention.norm(x), position)
    return x + block.feed_forward.sublayer(block.feed_forward.norm(x))


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_cell_matches_its_residuals_by_hand_outputs_and_gradients(family) -> None:
    model = _model(family)
    block, position = model.stack.layers["1"], model.stack.position
    with torch.no_grad():
        for conv in (block.convolutions.sublayer.narrow_conv, block.convolutions.sublayer.depthwise_conv):
            conv.weight.normal_(std=0.3)  # larger than the init, so a misplaced tap shows
    causal = family == "decoder"
    # conv1d sums in another order than the loop: a relative 1e-4 (a misplaced tap is off by O(1))
    assert_matches_by_hand(block, lambda x: block(x, position), lambda x: _cell_by_hand(block, position, x, causal),
                           torch.randn(2, 12, 16), rtol=1e-4, atol=1e-5)


def test_a_decoder_cell_reads_no_future_token() -> None:
    model = _model("decoder")
    tokens = torch.randint(0, 32, (1, 12))
    changed = tokens.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 32
    torch.testing.assert_close(model(tokens)[:, :7], model(changed)[:, :7])
