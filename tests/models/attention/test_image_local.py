"""Image Transformer 2-D local attention (Parmar et al. 2018): query blocks over a grid against a loop over each
pixel's memory block (with gradients, a partial last row, both directions), bad options refused, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError

WIDTH, BLOCK, MARGIN = 5, (2, 2), (1, 1)


def loop_reference(q, k, v, causal: bool) -> torch.Tensor:
    """Pixel (r, c) in block (R, C) reads rows [R q_h - h_m, R q_h + q_h (+ h_m)) and columns
    [C q_w - w_m, C q_w + q_w + w_m), earlier pixels only when causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length = q.shape[2]
    out = torch.zeros_like(q)
    for i in range(length):
        r, c = divmod(i, WIDTH)
        first_row, first_column = r - r % BLOCK[0] - MARGIN[0], c - c % BLOCK[1] - MARGIN[1]
        last_row = r - r % BLOCK[0] + BLOCK[0] - 1 + (0 if causal else MARGIN[0])
        last_column = c - c % BLOCK[1] + BLOCK[1] - 1 + MARGIN[1]
        keys = [j for j in range(length) if first_row <= j // WIDTH <= last_row
                and first_column <= j % WIDTH <= last_column and (j <= i or not causal)]
        probs = torch.softmax(q[:, :, i, None] @ k[:, :, keys].transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        out[:, :, i] = (probs @ v[:, :, keys])[:, :, 0]
    return out


@pytest.mark.parametrize("causal,length", [(False, 20), (True, 20), (False, 17), (True, 23)],
                         ids=["bidirectional", "causal", "bidirectional-partial-row", "causal-partial-row"])
def test_matches_the_loop_reference(causal: bool, length: int) -> None:
    core = make_core("image_local", causal, {"grid_width": WIDTH, "query_block": list(BLOCK),
                                             "memory_margin": list(MARGIN)})
    q, k, v = random_qkv(2, 4, length, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("options,message", [({"grid_width": 0}, "grid_width must be >= 1"),
                                             ({"query_block": [2]}, r"query_block must be \[rows, columns\]"),
                                             ({"memory_margin": [1, -1]}, r"memory_margin must be \[rows, columns\]")])
def test_refuses_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_core("image_local", True, options)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("image_local", {"grid_width": 4, "query_block": [2, 2], "memory_margin": [1, 1]}, family=family)
