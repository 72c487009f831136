"""FNet (Lee-Thorp et al. 2022): Re(F_T V F_d) with the DFT matrices written out, the decoder refusal, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention.core import build_core


def dft_matrix(n: int) -> torch.Tensor:
    """W[j, k] = exp(-2 pi i j k / n)."""
    index = torch.arange(n, dtype=torch.float64)
    angle = -2 * math.pi * index[:, None] * index[None, :] / n
    return torch.complex(torch.cos(angle), torch.sin(angle))


def test_matches_the_dft_matrices() -> None:
    core = make_core("fnet", False, d_model=32)
    q, k, v = random_qkv(2, 4, 10, 8, kv_heads=2)
    out = core(q, k, v, causal=False)
    values = v.repeat_interleave(2, 1).to(torch.complex128)
    ref = (dft_matrix(10) @ values @ dft_matrix(8)).real
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, v, grad)[0], torch.autograd.grad(ref, v, grad)[0],
                               atol=1e-10, rtol=1e-10)


def test_refused_in_a_decoder() -> None:
    with pytest.raises(ConfigError, match="'fnet' cannot be causally masked"):
        build_core("fnet", ModelConfig(n_heads=4, d_model=64), 0, {}, True, False)


def test_trains() -> None:
    assert_loss_falls("fnet", family="encoder")
