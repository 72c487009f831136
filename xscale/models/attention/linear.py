"""Linearized attention: phi(Q) (phi(K)^T V) / phi(Q) sum phi(K) (Katharopoulos et al. 2020, eq. 4-6, phi = elu + 1).

The causal form (eq. 8-9) runs over chunks of C positions: inside a chunk a masked C x C product, across
chunks a running state S = sum phi(k) v^T (m x d) and z = sum phi(k) kept once per chunk, so memory is
T/C x m x d, never T x m x d. :func:`kernelized_attention` is shared with the random-feature variants.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Sum of the entries strictly before each index along ``dim``."""
    total = x.cumsum(dim)
    return torch.cat([torch.zeros_like(total.narrow(dim, 0, 1)), total.narrow(dim, 0, x.shape[dim] - 1)], dim)


def kernelized_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk: int,
                         eps: float = 1e-6) -> Tensor:
    """phi_q, phi_k (B, H, T, m) feature maps, v (B, H, T, d) -> (B, H, T, d)."""
    if not causal:
        state = phi_k.transpose(-1, -2) @ v  # (B, H, m, d)
        normaliser = phi_k.sum(-2)  # (B, H, m)
        numerator = phi_q @ state
        denominator = (phi_q @ normaliser.unsqueeze(-1)).squeeze(-1)
        return numerator / denominator.clamp_min(eps).unsqueeze(-1)
    batch, heads, length, _ = phi_q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    phi_q, phi_k, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v))
    phi_q, phi_k, v = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1]) for x in (phi_q, phi_k, v))
    within = (phi_q @ phi_k.transpose(-1, -2)).tril()  # (B, H, n, C, C)
    state = _exclusive_cumsum(phi_k.transpose(-1, -2) @ v, dim=2)  # (B, H, n, m, d): chunks before this one
    normaliser = _exclusive_cumsum(phi_k.sum(-2), dim=2)  # (B, H, n, m)
    numerator = within @ v + phi_q @ state
    denominator = within.sum(-1) + (phi_q @ normaliser.unsqueeze(-1)).squeeze(-1)
    out = numerator / denominator.clamp_min(eps).unsqueeze(-1)
    return out.reshape(batch, heads, n_chunks * chunk, -1)[:, :, :length]


def kernelized_reference(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, eps: float = 1e-6) -> Tensor:
    """The quadratic form of the same kernel attention (test reference): A = phi_q phi_k^T, row-normalised."""
    weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        weights = weights.tril()
    return (weights @ v) / weights.sum(-1, keepdim=True).clamp_min(eps)


@dataclasses.dataclass
class LinearOptions:
    chunk: int = 64

    def __post_init__(self) -> None:
        require_positive("linear", chunk=self.chunk)


@ATTENTION.register("linear")
class LinearAttention(AttentionCore):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020)."""

    Options = LinearOptions

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None) -> Tensor:
        require(q.shape[2] == k.shape[2] or not causal, "causal linear attention needs equal query and key lengths")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return kernelized_attention(F.elu(q) + 1, F.elu(k) + 1, v, causal=causal, chunk=self.options.chunk)
