"""Lite Transformer's LSRA (Wu et al. 2020): attention on half the channels, a lightweight convolution on the other
half, against a hand-written loop over tokens."""

from __future__ import annotations

import pytest
import torch

from tests.models.blocks.conftest import assert_matches_by_hand, tiny_model
from xscale.config.schema import Component

KERNEL, HEADS = 3, 2


def _model(family: str = "decoder"):
    return tiny_model(Component("lite", {"kernel_size": KERNEL, "conv_heads": HEADS}), family=family, n_heads=4,
                      position="rope" if family == "decoder" else "learned")


def _convolution_by_hand(convolution, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """out[t, c] = sum_j softmax(W[h(c)])_j x[t + j - p, c], zero outside the sequence."""
    weight = torch.softmax(convolution.kernel, dim=-1)
    length, channels = x.shape[1], x.shape[2]
    before = KERNEL - 1 if causal else (KERNEL - 1) // 2
    out = torch.zeros_like(x)
    for t in range(length):
        for c in range(channels):
            for j in range(KERNEL):
                source = t + j - before
                if 0 <= source < length:
                    out[:, t, c] = out[:, t, c] + weight[c // (channels // HEADS), j] * x[:, source, c]
    return out


def _lsra_by_hand(lsra, position, x: torch.Tensor, causal: bool) -> torch.Tensor:
    branch = lsra.branch
    local = branch.w_value(x[..., 8:]) * torch.sigmoid(branch.w_gate(x[..., 8:]))  # GLU
    return torch.cat([lsra.attention(x[..., :8], position),
                      branch.w_out(_convolution_by_hand(branch.convolution, local, causal))], dim=-1)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_lsra_matches_the_hand_written_loop_outputs_and_gradients(family) -> None:
    model = _model(family)
    lsra, position = model.stack.layers["0"].attention.sublayer, model.stack.position
    with torch.no_grad():
        lsra.branch.convolution.kernel.normal_()  # not the uniform start, so the kernel's order shows
    causal = family == "decoder"
    assert_matches_by_hand(lsra, lambda x: lsra(x, position), lambda x: _lsra_by_hand(lsra, position, x, causal),
                           torch.randn(2, 6, 16))


def test_a_decoder_block_reads_no_future_token() -> None:
    model = _model()
    tokens = torch.randint(0, 32, (1, 8))
    changed = tokens.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 32
    torch.testing.assert_close(model(tokens)[:, :5], model(changed)[:, :5])
