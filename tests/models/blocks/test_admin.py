"""Admin initialisation (Liu et al. 2020): post-norm residuals LN(omega * x + f(x)), omega_i = sqrt(i)."""

from __future__ import annotations

import math

import pytest
import torch

from xscale.config.schema import ModelConfig
from xscale.models import build_model

ADMIN = dict(vocab_size=32, d_model=16, n_layers=3, n_heads=2, max_seq_len=8, norm="layernorm",
             norm_placement="post", init="admin")


def test_omega_is_the_root_of_the_residuals_before_it_in_each_stack() -> None:
    model = build_model(ModelConfig(**ADMIN), seed=0)
    omegas = [float(p.detach()[0]) for name, p in model.named_parameters() if name.endswith("admin_omega")]
    assert omegas == pytest.approx([math.sqrt(i) for i in range(1, 7)], rel=1e-6)
    encoder_decoder = build_model(ModelConfig(**ADMIN | {"family": "encoder_decoder", "n_decoder_layers": 2}), seed=0)
    decoder = {name: float(p.detach()[0]) for name, p in encoder_decoder.named_parameters()
               if name.startswith("decoder.") and name.endswith("admin_omega")}
    assert decoder["decoder.layers.1.cross_attention.gain.admin_omega"] == pytest.approx(math.sqrt(5), rel=1e-6)  # attention, cross, ffn


def test_admin_residual_is_layernorm_of_omega_x_plus_f_x_with_gradients() -> None:
    model = build_model(ModelConfig(**ADMIN), seed=0)
    residual = model.stack.layers["2"].feed_forward
    x = torch.randn(2, 8, 16)
    out = residual(x)
    omega = residual.gain.admin_omega
    torch.testing.assert_close(out, residual.norm(omega * x + residual.sublayer(x)))
    out.pow(3).sum().backward()
    expected = torch.autograd.grad(residual.norm(omega * x + residual.sublayer(x)).pow(3).sum(), omega)[0]
    torch.testing.assert_close(omega.grad, expected)


def test_default_init_keeps_the_standard_state_dict() -> None:
    names = {name for name, _ in build_model(ModelConfig(**ADMIN | {"init": "normal"}), seed=0).named_parameters()}
    assert not any("admin_omega" in name for name in names)


def test_omega_counts_a_macaron_blocks_first_ffn_and_a_sandwich_blocks_sub_layers() -> None:
    macaron = build_model(ModelConfig(**ADMIN | {"block": "macaron"}), seed=0)
    omega = dict(macaron.named_parameters())["stack.layers.1.feed_forward_first.gain.admin_omega"]
    assert float(omega.detach()[0]) == pytest.approx(math.sqrt(4), rel=1e-6)  # after the 3 residuals of layer 0
    sandwich = build_model(ModelConfig(**ADMIN | {"block": "sandwich"}), seed=0)
    omega = dict(sandwich.named_parameters())["stack.layers.2.sublayers.1.gain.admin_omega"]
    assert float(omega.detach()[0]) == pytest.approx(math.sqrt(6), rel=1e-6)
