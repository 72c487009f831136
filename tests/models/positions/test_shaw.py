"""Shaw et al. 2018 relative attention against a loop over (i, j) of eqs. 3-5, through the attention module."""

from __future__ import annotations

import math

import pytest
import torch

import xscale.models.zoo  # noqa: F401  (registers every component)
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.attention import Attention
from xscale.models.positions.shaw import ShawOptions, ShawRelativePosition


def _attention(causal: bool, kv_heads: int, max_distance: int) -> tuple[Attention, ShawRelativePosition]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_kv_heads=kv_heads, position="shaw", max_seq_len=16)
    attention = Attention(config, 0, causal=causal, uses_bias=True, mixes_values=True)
    position = ShawRelativePosition(16, 4, 4, 16, causal, options=ShawOptions(max_distance))
    torch.nn.init.normal_(position.key_table)
    torch.nn.init.normal_(position.value_table)
    return attention, position


def loop_reference(attention: Attention, position: ShawRelativePosition, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """e_ij = q_i (k_j + a^K_ij) / sqrt(d), z_i = sum_j softmax_j(e_ij) (v_j + a^V_ij), one (b, h, i, j) at a time."""
    batch, length, _ = x.shape
    heads, head_dim, kmax = attention.n_heads, attention.head_dim, position.max_distance
    q = attention.wq(x).view(batch, length, heads, head_dim)
    k = attention.wk(x).view(batch, length, -1, head_dim)
    v = attention.wv(x).view(batch, length, -1, head_dim)
    group = heads // k.shape[2]
    out = torch.zeros(batch, length, heads, head_dim)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = range(i + 1) if causal else range(length)
                row = [max(-kmax, min(kmax, j - i)) + kmax for j in keys]
                e = torch.stack([q[b, i, h] @ (k[b, j, h // group] + position.key_table[r]) / math.sqrt(head_dim)
                                 for j, r in zip(keys, row)])
                alpha = torch.softmax(e, dim=0)
                out[b, i, h] = sum(alpha[n] * (v[b, j, h // group] + position.value_table[r])
                                   for n, (j, r) in enumerate(zip(keys, row)))
    return attention.wo(out.reshape(batch, length, -1))


@pytest.mark.parametrize("causal,kv_heads,max_distance", [(True, 4, 2), (False, 2, 3), (False, 4, 16)])
def test_matches_the_loop_over_pairs_with_gradients(causal: bool, kv_heads: int, max_distance: int) -> None:
    attention, position = _attention(causal, kv_heads, max_distance)
    x = torch.randn(2, 7, 16)
    got = attention(x, position)
    want = loop_reference(attention, position, x, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), [position.key_table, position.value_table])
    wants = torch.autograd.grad((want * weights).sum(), [position.key_table, position.value_table])
    for grad, expected in zip(grads, wants):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_clipping_makes_distant_keys_share_a_row() -> None:
    position = ShawRelativePosition(16, 4, 4, 16, False, options=ShawOptions(2))
    rows = position._buckets(6, 6, torch.device("cpu"))
    assert rows[0].tolist() == [2, 3, 4, 4, 4, 4] and rows[5].tolist() == [0, 0, 0, 0, 1, 2]


def test_refuses_a_core_without_probabilities() -> None:
    with pytest.raises(ConfigError, match="attention 'gaussian'.*model.position=shaw.*kind=dense"):
        build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, position="shaw",
                                attention=AttentionConfig(kind="gaussian")), seed=0)
