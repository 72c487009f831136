"""Skyformer (Chen et al. 2021, "Skyformer: Remodel Self-Attention with Gaussian Kernel and Nystrom Method"): the
softmax kernel replaced by the Gaussian kernel, without row normalisation, and approximated by Nystrom on the
symmetric kernel matrix of the queries and keys together,

  kappa(q, k) = exp(-||q - k||^2 / (2 sqrt(d)))                      (the Gaussian kernel, sec. 3)
  C = [Q ; K],   kappa(C, C) ~ kappa(C, L) kappa(L, L)^+ kappa(L, C)   (Nystrom on the (2T x 2T) PSD matrix, sec. 4)
  O = kappa(Q, L) kappa(L, L)^+ (kappa(L, K) V),

O(T m d) for 2m landmarks L. The pseudo-inverse is Nystromformer's iteration (``pinv_iterations``, Razavi et al.
2014); with every query and key a landmark the product is kappa(Q, K) V exactly.

Departures: the landmarks are the means of m contiguous segments of Q and of K (Nystromformer's choice; the paper
samples landmark rows). Encoder only (the landmarks average the future). Heads are independent: tensor parallelism
splits heads; context parallelism runs it on the gathered sequence. No attention probabilities are formed, so
attention dropout does not apply.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.lowrank import iterative_pinv, segment_means
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class SkyformerOptions:
    landmarks: int = dataclasses.field(default=8, metadata={"help": "m: segment means of Q and of K (2m landmarks)"})
    pinv_iterations: int = dataclasses.field(default=6, metadata={"help": "iterations of the pseudo-inverse"})

    def __post_init__(self) -> None:
        require_positive("skyformer", landmarks=self.landmarks, pinv_iterations=self.pinv_iterations)


def gaussian_kernel(x: Tensor, y: Tensor) -> Tensor:
    """exp(-||x_i - y_j||^2 / (2 sqrt(d))) (..., Tx, Ty)."""
    x, y = x * x.shape[-1] ** -0.25, y * y.shape[-1] ** -0.25
    squared = (x * x).sum(-1)[..., :, None] + (y * y).sum(-1)[..., None, :] - 2 * x @ y.transpose(-1, -2)
    return torch.exp(-0.5 * squared.clamp_min(0))


@ATTENTION.register("skyformer")
class SkyformerAttention(AttentionCore):
    """Gaussian-kernel attention by symmetric Nystrom over [Q ; K] (Chen et al. 2021)."""

    Options = SkyformerOptions
    causal_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # the Nystrom factors are no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        landmarks = min(self.options.landmarks, q.shape[2], k.shape[2])
        points = torch.cat([segment_means(q, landmarks), segment_means(k, landmarks)], dim=2)  # (B, H, 2m, d)
        inverse = iterative_pinv(gaussian_kernel(points, points), self.options.pinv_iterations)
        return gaussian_kernel(q, points) @ (inverse @ (gaussian_kernel(points, k) @ v))
