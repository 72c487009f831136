"""cosFormer (Qin et al. 2022): the linear-time decomposition equals the quadratic formula of eq. 9, causal and
not, and the causal form never reads the future."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import make_core, random_qkv
from xscale.config.schema import ConfigError

LENGTH, MAX_LENGTH = 45, 48  # M close to T, so the cosine re-weighting is far from 1 at long distances


def quadratic_cosformer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_length: int,
                        causal: bool) -> torch.Tensor:
    """O_i = sum_j s_ij V_j / sum_j s_ij, s_ij = ReLU(Q_i) ReLU(K_j)^T cos(pi/2 (i - j) / M) (eq. 9), as written."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    i = torch.arange(q.shape[2], dtype=q.dtype)[:, None]
    j = torch.arange(k.shape[2], dtype=q.dtype)[None, :]
    scores = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * torch.cos(math.pi / 2 * (i - j) / max_length)
    if causal:
        scores = scores.tril()
    return (scores @ v) / scores.sum(-1, keepdim=True).clamp_min(1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_quadratic_formula_in_fp32(causal: bool, kv_heads: int) -> None:
    core = make_core("cosformer", causal, {"chunk": 8}, max_seq_len=MAX_LENGTH).float()
    q, k, v = (x.detach().float().requires_grad_() for x in random_qkv(2, 4, LENGTH, 16, kv_heads=kv_heads))
    out = core(q, k, v, causal=causal)
    ref = quadratic_cosformer(q, k, v, MAX_LENGTH, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_cosine_reweighting_matters() -> None:
    """Without the cosine the same features give plain ReLU linear attention, measurably different here."""
    q, k, v = random_qkv(1, 4, LENGTH, 16)
    plain = (F.relu(q) @ F.relu(k).transpose(-1, -2)) @ v / (F.relu(q) @ F.relu(k).transpose(-1, -2)).sum(-1, True)
    out = make_core("cosformer", False, max_seq_len=MAX_LENGTH)(q, k, v, causal=False)
    assert (out - plain).abs().max() > 1e-2


def test_causal_never_reads_the_future() -> None:
    core = make_core("cosformer", True, {"chunk": 8}, max_seq_len=MAX_LENGTH)
    q, k, v = random_qkv(1, 4, LENGTH, 16)
    out = core(q, k, v, causal=True)
    changed_k, changed_v = k.detach().clone(), v.detach().clone()
    changed_k[:, :, 30:] += 5.0
    changed_v[:, :, 30:] -= 5.0
    again = core(q, changed_k, changed_v, causal=True)
    torch.testing.assert_close(again[:, :, :30], out[:, :, :30], atol=1e-12, rtol=1e-12)


def test_refuses_sequences_longer_than_max_seq_len() -> None:
    core = make_core("cosformer", False, max_seq_len=32)
    with pytest.raises(ConfigError, match="raise model.max_seq_len"):
        core(*random_qkv(1, 4, 40, 16), causal=False)
