"""Skyformer (Chen et al. 2021): the Gaussian kernel entry by entry, the Nystrom product against the explicit
(T x T) approximation with an exact pseudo-inverse, the exact limit (every token a landmark), training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention.core import build_core
from xscale.models.attention.skyformer import gaussian_kernel

LENGTH = 12


def test_gaussian_kernel_entry_by_entry() -> None:
    x, y = torch.randn(5, 8, dtype=torch.float64), torch.randn(7, 8, dtype=torch.float64)
    want = torch.tensor([[math.exp(-float(((a - b) ** 2).sum()) / (2 * math.sqrt(8))) for b in y] for a in x],
                        dtype=torch.float64)
    torch.testing.assert_close(gaussian_kernel(x, y), want, atol=1e-12, rtol=1e-12)


def explicit_nystrom(q, k, v, landmarks: int) -> torch.Tensor:
    """The (T x T) matrix kappa(Q, L) pinv(kappa(L, L)) kappa(L, K) formed whole (torch.linalg.pinv), times V; L the
    means of ``landmarks`` contiguous segments of Q and of K."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

    def means(x):
        return torch.stack([x[:, :, s * LENGTH // landmarks:(s + 1) * LENGTH // landmarks].mean(2)
                            for s in range(landmarks)], dim=2)

    points = torch.cat([means(q), means(k)], dim=2)
    matrix = gaussian_kernel(q, points) @ torch.linalg.pinv(gaussian_kernel(points, points), hermitian=True) \
        @ gaussian_kernel(points, k)
    return matrix @ v


def test_matches_the_explicit_nystrom_matrix() -> None:
    core = make_core("skyformer", False, {"landmarks": 3, "pinv_iterations": 30})
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=False)
    ref = explicit_nystrom(q, k, v, 3)
    torch.testing.assert_close(out, ref, atol=1e-8, rtol=1e-8)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_every_token_a_landmark_is_the_exact_kernel() -> None:
    """With m = T every query and key is a landmark: Nystrom reproduces kappa(Q, K) V."""
    core = make_core("skyformer", False, {"landmarks": 6, "pinv_iterations": 60})
    q, k, v = random_qkv(1, 2, 6, 8, scale=0.5)
    torch.testing.assert_close(core(q, k, v, causal=False), gaussian_kernel(q, k) @ v, atol=1e-5, rtol=1e-5)


def test_refused_in_a_decoder() -> None:
    with pytest.raises(ConfigError, match="'skyformer' cannot be causally masked"):
        build_core("skyformer", ModelConfig(n_heads=4, d_model=64), 0, {}, True, False)


def test_trains() -> None:
    assert_loss_falls("skyformer", {"landmarks": 4}, family="encoder")
