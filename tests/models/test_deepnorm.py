"""DeepNorm's alpha and beta (Wang et al. 2022, fig. 2) by hand, and its Xavier init with gain beta in a model."""

from __future__ import annotations

import math

import pytest
import torch

from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.models.deepnorm import deepnorm_scales


def test_decoder_only_and_encoder_only_scales() -> None:
    alpha, beta = deepnorm_scales(ModelConfig(n_layers=2), in_decoder=False)
    assert alpha == pytest.approx(4**0.25) and beta == pytest.approx(16**-0.25)  # (2N)^(1/4), (8N)^(-1/4)
    alpha, beta = deepnorm_scales(ModelConfig(family="encoder", n_layers=18), in_decoder=False)
    assert alpha == pytest.approx(36**0.25) and beta == pytest.approx(144**-0.25)


def test_encoder_decoder_scales() -> None:
    config = ModelConfig(family="encoder_decoder", n_layers=6, n_decoder_layers=3)
    alpha, beta = deepnorm_scales(config, in_decoder=False)
    assert alpha == pytest.approx(0.81 * (6**4 * 3) ** (1 / 16)) and beta == pytest.approx(0.87 * (6**4 * 3) ** (-1 / 16))
    alpha, beta = deepnorm_scales(config, in_decoder=True)
    assert alpha == pytest.approx(9**0.25) and beta == pytest.approx(36**-0.25)  # (3M)^(1/4), (12M)^(-1/4)


def test_projections_are_xavier_normal_with_gain_beta() -> None:
    """v, out and FFN projections: std beta sqrt(2 / (fan_in + fan_out)); q and k: gain 1; the residual alpha
    scales the stream; no final norm (post-norm)."""
    config = ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, norm="layernorm",
                         norm_placement="deepnorm", ffn="gelu", d_ff=256)
    model = build_model(config, seed=0)
    beta = 16**-0.25
    block = model.stack.layers["1"]
    expected = {block.attention.sublayer.wq.weight: math.sqrt(2 / 128),
                block.attention.sublayer.wk.weight: math.sqrt(2 / 128),
                block.attention.sublayer.wv.weight: beta * math.sqrt(2 / 128),
                block.attention.sublayer.wo.weight: beta * math.sqrt(2 / 128),
                block.feed_forward.sublayer.w_in.weight: beta * math.sqrt(2 / 320),
                block.feed_forward.sublayer.w_out.weight: beta * math.sqrt(2 / 320)}
    for weight, std in expected.items():
        assert float(weight.detach().std()) == pytest.approx(std, rel=0.05)
    assert block.attention.residual_scale == pytest.approx(4**0.25)
    assert model.stack.final_norm is None


def test_the_block_is_norm_of_alpha_x_plus_f_x() -> None:
    config = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, norm="layernorm", norm_placement="deepnorm")
    residual = build_model(config, seed=0).stack.layers["0"].feed_forward
    x = torch.randn(2, 5, 16)
    want = torch.nn.functional.layer_norm(6**0.25 * x + residual.sublayer(x), (16,), residual.norm.weight,
                                          residual.norm.bias)
    torch.testing.assert_close(residual(x), want)
