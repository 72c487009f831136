"""Shared setup of the block-kind tests: the tiny model, and the check of a block (or sub-layer) against its
equations written out by hand, outputs and gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from xscale.config.schema import Component, ModelConfig
from xscale.models import build_model

TINY = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)


def tiny_model(block: str | Component = "standard", **fields) -> nn.Module:
    """The tiny model (:data:`TINY`, any field overridden) with block kind ``block``, seed 0."""
    return build_model(ModelConfig(**TINY | fields | {"block": block}), seed=0)


def assert_matches_by_hand(module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                           by_hand: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                           **tolerance) -> dict[str, torch.Tensor]:
    """``forward(x)`` equals ``by_hand(x)``, and so do the gradients of the sum of its squares with respect to ``x``
    and to every parameter of ``module`` (``tolerance``: rtol/atol of ``assert_close``). Returns the parameters'
    gradients through ``forward``."""
    x = x.detach().clone().requires_grad_(True)
    reference_x = x.detach().clone().requires_grad_(True)
    out = forward(x)
    torch.testing.assert_close(out, by_hand(x), **tolerance)
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    by_hand(reference_x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad, **tolerance)
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name, **tolerance)
    return grads
