"""cosFormer (Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention"): linear attention whose similarity is
ReLU features re-weighted by a cosine of the distance,

  s(Q_i, K_j) = ReLU(Q_i) ReLU(K_j)^T cos(pi/2 * (i - j) / M)       (eq. 9, M >= every position used)
  O_i = sum_j s(Q_i, K_j) V_j / sum_j s(Q_i, K_j)                   (eq. 4; j <= i when causal).

cos(a - b) = cos a cos b + sin a sin b splits the weight into the two feature maps (eq. 10-11)
  phi(Q_i) = [ReLU(Q_i) cos(pi i / 2M), ReLU(Q_i) sin(pi i / 2M)],  phi(K_j) likewise,
so the product is kernelized attention with 2d features, O(T d^2), computed by the causal chunked prefix sums of
:func:`~xscale.models.attention.linear.kernelized_attention`. M is ``model.max_seq_len``: fixed, so a token's
weights do not change as the sequence grows (causal decoding reads what training did). Heads are independent,
so tensor parallelism splits the heads. Under context parallelism a rank's queries take the weights of their global
positions against the all-gathered keys (:func:`~xscale.models.attention.linear.kernelized_attention_at`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv, held_query_positions
from xscale.models.attention.linear import kernelized_attention, kernelized_attention_at
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class CosFormerOptions:
    chunk: int = 64  # C: positions per chunk of the causal prefix sums

    def __post_init__(self) -> None:
        require_positive("cosformer", chunk=self.chunk)


def cos_reweighted_features(x: Tensor, max_length: int, positions: Tensor | None = None) -> Tensor:
    """(B, H, T, d) -> (B, H, T, 2d): [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi i / 2M)] for positions i < M
    (``positions`` (T): the tokens' positions; None: 0..T-1)."""
    if positions is None:
        positions = torch.arange(x.shape[2], device=x.device)
    angle = positions.to(torch.float32) * (math.pi / (2 * max_length))
    cos, sin = (weight.to(x.dtype)[:, None] for weight in (angle.cos(), angle.sin()))
    features = F.relu(x)
    return torch.cat([features * cos, features * sin], dim=-1)


@ATTENTION.register("cosformer")
class CosFormerAttention(AttentionCore):
    """ReLU features with cos-based re-weighting (Qin et al. 2022, eq. 9-11)."""

    Options = CosFormerOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_positions=True)

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # re-weighted linear attention forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        max_length = self.model_config.max_seq_len
        if (positions := held_query_positions(q, k, context)) is not None:  # context parallelism
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
            return kernelized_attention_at(positions, cos_reweighted_features(q, max_length, positions),
                                           cos_reweighted_features(k, max_length), v, causal=causal,
                                           chunk=self.options.chunk)
        require(q.shape[2] == k.shape[2] or not causal, "causal cosformer attention needs equal query and key lengths")
        require(max(q.shape[2], k.shape[2]) <= max_length,
                f"cosformer re-weights by cos(pi/2 (i - j) / M) with M = model.max_seq_len={max_length}; got "
                f"{max(q.shape[2], k.shape[2])} positions: raise model.max_seq_len")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return kernelized_attention(cos_reweighted_features(q, max_length), cos_reweighted_features(k, max_length),
                                    v, causal=causal, chunk=self.options.chunk)
