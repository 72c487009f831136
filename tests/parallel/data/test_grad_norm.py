"""The global gradient norm from one rank's pieces (no process group: the sum over ranks is this rank's)."""

from __future__ import annotations

import math

import pytest
import torch

from xscale.parallel.data.grad_norm import GradientPiece, clip_gradients, global_grad_norm


def _pieces() -> list[GradientPiece]:
    torch.manual_seed(0)
    return [GradientPiece(torch.randn(30, 7), 1), GradientPiece(torch.randn(5), 4),
            GradientPiece(torch.randn(3, 3).bfloat16(), 2), GradientPiece(torch.randn(8), 1, counted=False),
            GradientPiece(torch.empty(0), 1)]


def test_each_counted_piece_adds_its_square_norm_over_its_replicas():
    pieces = _pieces()
    expected = math.sqrt(sum(piece.grad.double().square().sum().item() / piece.replicas
                             for piece in pieces if piece.counted))
    assert global_grad_norm(pieces).item() == pytest.approx(expected)


def test_clipping_scales_every_piece_counted_or_not_to_the_max_norm():
    pieces, before = _pieces(), [piece.grad.clone() for piece in _pieces()]
    norm = clip_gradients(pieces, max_norm=1.0)
    coefficient = 1.0 / (norm.item() + 1e-6)
    for piece, grad in zip(pieces, before):
        assert piece.grad.dtype == grad.dtype
        torch.testing.assert_close(piece.grad, (grad.double() * coefficient).to(grad.dtype))
    assert global_grad_norm(pieces).item() == pytest.approx(1.0, rel=1e-2)  # the bf16 piece rounds


def test_a_norm_below_the_max_leaves_the_gradients_alone():
    pieces, before = _pieces(), [piece.grad.clone() for piece in _pieces()]
    clip_gradients(pieces, max_norm=1e6)
    for piece, grad in zip(pieces, before):
        assert torch.equal(piece.grad, grad)

