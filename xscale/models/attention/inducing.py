"""Attention through m learned points: the points pool the sequence, the queries read the pool.

  A = softmax(P K^T / sqrt(d))  (m x T);   K~ = A K,  V~ = A V;   out = softmax(Q K~^T / sqrt(d)) V~.

This is the attention of the Set Transformer's ISAB (Lee et al. 2019: H = MAB(I, X), out = MAB(X, H))
with the pooled keys and values taken with the same weights A, and without the MAB's inner LayerNorm and
feed-forward (the block around the core supplies those). Cost T * m. The pool reads every position, so the
core is encoder-only; Luna's causal packing is in :mod:`xscale.models.attention.luna`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def pool(k: Tensor, v: Tensor, points: Tensor) -> tuple[Tensor, Tensor]:
    """k/v (B, H, Tk, d), points (H, m, d) -> the pooled keys and values A K, A V (B, H, m, d)."""
    weights = torch.softmax(points.to(k.dtype) @ k.transpose(-1, -2) * k.shape[-1] ** -0.5, dim=-1)  # (B, H, m, Tk)
    return weights @ k, weights @ v


class PooledAttention(AttentionCore):
    """Holds the per-head points (H, m, d_head); subclasses name the option that sets m."""

    per_head_state = ("points",)
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options, n_points: int) -> None:
        super().__init__(model, layer_index, options)
        self.points = nn.Parameter(torch.empty(model.n_heads, n_points, model.head_dim))

    def pooled(self, q: Tensor, k: Tensor, v: Tensor, context: StepContext | None = None) -> Tensor:
        check_heads(self, self.points, q.shape[1])
        # Attention dropout on the queries' probabilities over the m pooled slots (B, H, Tq, m), not on the pool.
        keys, values = pool(expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), self.points)
        return self.attend(q, keys, values, context=context)


@dataclasses.dataclass
class InducingOptions:
    inducing_points: int = 16

    def __post_init__(self) -> None:
        require_positive("inducing", inducing_points=self.inducing_points)


@ATTENTION.register("inducing", "isab")
class InducingPointAttention(PooledAttention):
    Options = InducingOptions
    causal_capable = False

    def __init__(self, model: ModelConfig, layer_index: int, options: InducingOptions) -> None:
        super().__init__(model, layer_index, options, options.inducing_points)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        require(not causal, "inducing-point attention cannot be causally masked (the points pool every "
                            "position); use an encoder, or 'luna' for a causal packed attention")
        return self.pooled(q, k, v, context)
