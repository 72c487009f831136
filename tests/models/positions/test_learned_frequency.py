"""Learned-frequency sinusoids: the encoding entry by entry (sin at even, cos at odd features), equal to the fixed
sinusoid with zero offsets, gradients reaching the frequencies, a rank's global positions, training."""

from __future__ import annotations

import math

import torch

from tests.models.attention.conftest import assert_loss_falls
from xscale.models.position import SinusoidalPosition
from xscale.models.positions.learned_frequency import LearnedFrequencySinusoid
from xscale.runtime import StepContext


def _position(d_model: int = 6) -> LearnedFrequencySinusoid:
    return LearnedFrequencySinusoid(d_model, 2, d_model // 2, 16, True).double()


def test_entry_by_entry_with_gradients() -> None:
    position = _position()
    with torch.no_grad():
        position.log_frequency_offset.copy_(torch.tensor([0.3, -0.2, 0.1]))
    x = torch.zeros(1, 5, 6, dtype=torch.float64)
    out = position.embed(x)
    offsets = position.log_frequency_offset
    want = torch.stack([torch.stack([
        (torch.sin if feature % 2 == 0 else torch.cos)(
            pos * 10000.0 ** (-(feature - feature % 2) / 6) * torch.exp(offsets[feature // 2]))
        for feature in range(6)]) for pos in range(5)])[None]
    torch.testing.assert_close(out, want.to(out.dtype), atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, offsets, grad)[0], torch.autograd.grad(want, offsets, grad)[0],
                               atol=1e-5, rtol=1e-5)


def test_zero_offsets_are_the_fixed_sinusoid() -> None:
    x = torch.randn(2, 9, 8)
    fixed = SinusoidalPosition(8, 2, 4, 16, True)
    learned = LearnedFrequencySinusoid(8, 2, 4, 16, True)
    torch.testing.assert_close(learned.embed(x), fixed.embed(x), atol=1e-5, rtol=1e-5)
    assert math.isclose(float(learned.frequencies()[1].detach()), 10000 ** (-2 / 8), rel_tol=1e-6)


def test_a_context_parallel_rank_encodes_its_global_positions() -> None:
    class Held:  # the second half of a 12-token sequence
        def coordinates(self, size, device):
            return torch.arange(6, 12, device=device)

        def global_size(self, size):
            return 12

    position = _position()
    whole = position.embed(torch.zeros(1, 12, 6, dtype=torch.float64))
    held = position.embed(torch.zeros(1, 6, 6, dtype=torch.float64), StepContext(sequence=Held()))
    torch.testing.assert_close(held, whole[:, 6:])


def test_trains() -> None:
    assert_loss_falls("dense", position="learned_frequency")
