"""Residual placements in a block: ReZero (Bachlechner et al. 2020), x + alpha f(x) with alpha from 0 and no norm."""

from __future__ import annotations

import torch

from xscale.config.schema import ModelConfig
from xscale.models import build_model

REZERO = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, norm_placement="rezero")


def test_rezero_starts_as_the_identity_and_has_no_norm() -> None:
    model = build_model(REZERO, seed=0)
    block = model.stack.layers["0"]
    alphas = [p for name, p in model.named_parameters() if name.endswith("rezero_alpha")]
    assert len(alphas) == 4 and all(alpha.shape == (1,) and float(alpha.detach()) == 0 for alpha in alphas)
    assert not any("norm" in name for name, _ in model.named_parameters())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(block(x, model.stack.position), x)


def test_rezero_is_x_plus_alpha_f_x_and_alpha_learns() -> None:
    model = build_model(REZERO, seed=0)
    residual = model.stack.layers["1"].feed_forward
    with torch.no_grad():
        residual.gain.rezero_alpha.fill_(0.5)
    x = torch.randn(2, 5, 16)
    out = residual(x)
    torch.testing.assert_close(out, x + 0.5 * residual.sublayer(x))
    out.pow(2).sum().backward()
    assert float(residual.gain.rezero_alpha.grad.abs()) > 0
