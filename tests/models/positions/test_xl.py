"""Transformer-XL relative attention (Dai et al. 2019, sec. 3.3) against a loop over (i, j) of its four terms."""

from __future__ import annotations

import math

import pytest
import torch

import xscale.models.zoo  # noqa: F401  (registers every component)
from xscale.config.schema import ModelConfig
from xscale.models.attention import Attention
from xscale.models.positions.xl import TransformerXLPosition


def _attention(causal: bool, kv_heads: int) -> tuple[Attention, TransformerXLPosition]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_kv_heads=kv_heads, position="xl", max_seq_len=16)
    attention = Attention(config, 0, causal=causal, uses_bias=True)
    position = TransformerXLPosition(16, 4, 4, 16, causal)
    for parameter in position.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    return attention, position


def sinusoid(delta: int, dim: int) -> torch.Tensor:
    """R_delta: sin then cos of delta / 10000^(2i/d), i < d/2."""
    frequencies = [1 / 10000 ** (2 * i / dim) for i in range(dim // 2)]
    return torch.tensor([math.sin(delta * f) for f in frequencies] + [math.cos(delta * f) for f in frequencies])


def loop_reference(attention: Attention, position: TransformerXLPosition, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """A_ij = q_i k_j + q_i W_R R_{i-j} + u k_j + v W_R R_{i-j} (over sqrt(d)), one (b, h, i, j) at a time."""
    batch, length, d_model = x.shape
    heads, head_dim = attention.n_heads, attention.head_dim
    q = attention.wq(x).view(batch, length, heads, head_dim)
    k = attention.wk(x).view(batch, length, -1, head_dim)
    v = attention.wv(x).view(batch, length, -1, head_dim)
    group = heads // k.shape[2]
    w_r = position.position_keys.view(heads, head_dim, d_model)
    out = torch.zeros(batch, length, heads, head_dim)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = list(range(i + 1) if causal else range(length))
                scores = []
                for j in keys:
                    r = w_r[h] @ sinusoid(i - j, d_model)
                    kj = k[b, j, h // group]
                    scores.append((q[b, i, h] @ kj + q[b, i, h] @ r + position.u[h] @ kj + position.v[h] @ r)
                                  / math.sqrt(head_dim))
                alpha = torch.softmax(torch.stack(scores), dim=0)
                out[b, i, h] = sum(alpha[n] * v[b, j, h // group] for n, j in enumerate(keys))
    return attention.wo(out.reshape(batch, length, -1))


@pytest.mark.parametrize("causal,kv_heads", [(True, 4), (False, 2), (True, 1)])
def test_matches_the_loop_over_pairs_with_gradients(causal: bool, kv_heads: int) -> None:
    attention, position = _attention(causal, kv_heads)
    x = torch.randn(2, 6, 16)
    got = attention(x, position)
    want = loop_reference(attention, position, x, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(got)
    parameters = list(position.parameters())
    grads = torch.autograd.grad((got * weights).sum(), parameters)
    wants = torch.autograd.grad((want * weights).sum(), parameters)
    for grad, expected in zip(grads, wants):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_each_term_matters() -> None:
    """With u, v or W_R zeroed the output changes: every term reaches the scores."""
    attention, position = _attention(True, 4)
    x = torch.randn(1, 5, 16)
    full = attention(x, position)
    for parameter in position.parameters():
        saved = parameter.detach().clone()
        with torch.no_grad():
            parameter.zero_()
        assert not torch.allclose(attention(x, position), full, atol=1e-4)
        with torch.no_grad():
            parameter.copy_(saved)
