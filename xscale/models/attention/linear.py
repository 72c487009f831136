"""Linearized attention: phi(Q) (phi(K)^T V) / phi(Q) sum phi(K) (Katharopoulos et al. 2020, eq. 4-6, phi = elu + 1).

The causal form (eq. 8-9) runs over chunks of C positions: inside a chunk a masked C x C product, across
chunks a running state S = sum phi(k) [v, 1]^T (m x (d + 1): the last column is the normaliser z = sum phi(k))
kept once per chunk, so memory is T/C x m x d, never T x m x d. :func:`kernelized_attention` is shared with the random-feature variants.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def kernelized_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk: int,
                         eps: float = 1e-6) -> Tensor:
    """phi_q, phi_k (B, H, T, m) feature maps, v (B, H, T, d) -> (B, H, T, d).

    The values carry an extra column of ones, so one product gives the numerator and (last column) the normaliser.
    """
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, T, d + 1)
    if not causal:
        out = phi_q @ (phi_k.transpose(-1, -2) @ values)
        return out[..., :-1] / out[..., -1:].clamp_min(eps)
    batch, heads, length, _ = phi_q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:
        phi_q, phi_k, values = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, values))
    phi_q, phi_k, values = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1]) for x in (phi_q, phi_k, values))
    out = (phi_q @ phi_k.transpose(-1, -2)).tril_() @ values  # inside each chunk: (B, H, n, C, d + 1)
    if n_chunks > 1:
        # chunk i reads the states of chunks < i: an exclusive prefix sum (B, H, n, m, d + 1), zero for chunk 0
        states = (phi_k.transpose(-1, -2) @ values).narrow(2, 0, n_chunks - 1)
        out = out + phi_q @ F.pad(states, (0, 0, 0, 0, 1, 0)).cumsum(dim=2)
    out = out.reshape(batch, heads, n_chunks * chunk, -1)[:, :, :length]
    return out[..., :-1] / out[..., -1:].clamp_min(eps)


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
    parallel_traits = ParallelTraits(tp="split_heads")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        require(q.shape[2] == k.shape[2] or not causal, "causal linear attention needs equal query and key lengths")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return kernelized_attention(F.elu(q) + 1, F.elu(k) + 1, v, causal=causal, chunk=self.options.chunk)
