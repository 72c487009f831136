"""alpha-entmax attention (Correia et al. 2019, "Adaptively Sparse Transformers"): the softmax of each row replaced
by alpha-entmax (Peters et al. 2019, eq. 2),

  alpha-entmax(z)_j = [(alpha - 1) z_j - tau]_+ ^ (1 / (alpha - 1)),   tau such that the row sums to 1,

which for 1 < alpha gives exactly zero weight to low-scoring keys (alpha -> 1: softmax, alpha = 2: sparsemax).
alpha = 1.5 is computed exactly by sorting (Peters et al. 2019, sec. 3.2, Algorithm 2), any other alpha in (1, 2] by
bisection on tau (Blondel et al. 2019, Algorithm 1). The gradient is the paper's closed form (Correia et al. 2019,
eq. 10): with s_j = p_j^(2 - alpha) on the support, dz = s * dp - s (s . dp) / sum(s).

Departure: alpha is one fixed value (``model.attention.options.alpha``) for every head; the paper also learns alpha
per head (sec. 3.3), which is not done here. Heads are independent and the core takes the causal mask and any
logit bias as additive -inf / bias terms over whole rows, so tensor parallelism splits heads and context
parallelism runs it over the all-gathered keys.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.attention.sparse import require
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class EntmaxOptions:
    alpha: float = dataclasses.field(default=1.5, metadata={"help": "the entmax alpha in (1, 2]: 1.5 exact by "
                                                                     "sorting, others by bisection; 2 = sparsemax"})
    bisect_iterations: int = dataclasses.field(default=50, metadata={"help": "bisection steps on tau (alpha != 1.5)"})

    def __post_init__(self) -> None:
        require(1.0 < self.alpha <= 2.0, f"model.attention.options.alpha must be in (1, 2] for 'entmax' "
                                         f"(got {self.alpha}); alpha -> 1 is softmax: use model.attention.kind=dense")
        require(self.bisect_iterations >= 1, "model.attention.options.bisect_iterations must be >= 1 for 'entmax' "
                                             f"(got {self.bisect_iterations})")


class _EntmaxGradient(torch.autograd.Function):
    """Base: the backward of any alpha-entmax from its output p (Correia et al. 2019, eq. 10)."""

    @staticmethod
    def backward(ctx, grad: Tensor):
        (p,) = ctx.saved_tensors
        slope = torch.where(p > 0, p.pow(2 - ctx.alpha), 0.0)
        grad_in = slope * grad
        grad_in = grad_in - slope * (grad_in.sum(-1, keepdim=True) / slope.sum(-1, keepdim=True))
        return grad_in, None, None


class Entmax15(_EntmaxGradient):
    """1.5-entmax over the last dim by sorting: with z' = z / 2 - max, sorted descending, the threshold of the k
    largest is tau_k = mean_k - sqrt((1 - k var_k) / k), and the support is the largest k with tau_k <= z'_(k)."""

    @staticmethod
    def forward(ctx, scores: Tensor, alpha: float = 1.5, unused: int = 0) -> Tensor:
        z = scores / 2
        z = z - z.amax(-1, keepdim=True)
        ordered = z.sort(dim=-1, descending=True).values
        count = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
        mean = ordered.cumsum(-1) / count
        mean_square = (ordered * ordered).cumsum(-1) / count
        spread = count * (mean_square - mean * mean)
        tau = mean - ((1 - spread) / count).clamp_min(0).sqrt()
        support = (tau <= ordered).sum(-1, keepdim=True)  # masked (-inf) keys give nan here and never count
        # At least one: a row of NaN (a pipeline's shape pass over uninitialised tensors) stays NaN, not an error.
        threshold = tau.gather(-1, support.clamp_min(1) - 1)
        p = (z - threshold).clamp_min(0) ** 2
        ctx.save_for_backward(p)
        ctx.alpha = 1.5
        return p


class EntmaxBisect(_EntmaxGradient):
    """alpha-entmax over the last dim by bisection on tau in [max - 1, max - n^(1 - alpha)] (on (alpha - 1) z), then
    normalised so the row sums to 1 exactly."""

    @staticmethod
    def forward(ctx, scores: Tensor, alpha: float, iterations: int) -> Tensor:
        z = scores * (alpha - 1)
        top = z.amax(-1, keepdim=True)
        low, high = top - 1, top - scores.shape[-1] ** (1 - alpha)
        power = 1 / (alpha - 1)
        for _ in range(iterations):
            tau = (low + high) / 2
            total = (z - tau).clamp_min(0).pow(power).sum(-1, keepdim=True)
            low = torch.where(total >= 1, tau, low)
            high = torch.where(total >= 1, high, tau)
        p = (z - low).clamp_min(0).pow(power)
        p = p / p.sum(-1, keepdim=True)
        ctx.save_for_backward(p)
        ctx.alpha = alpha
        return p


def entmax(scores: Tensor, alpha: float = 1.5, iterations: int = 50) -> Tensor:
    """alpha-entmax of ``scores`` over the last dim (-inf entries get 0)."""
    if alpha == 1.5:
        return Entmax15.apply(scores, 1.5, 0)
    return EntmaxBisect.apply(scores, alpha, iterations)


@ATTENTION.register("entmax")
class EntmaxAttention(AttentionCore):
    """O = alpha-entmax(Q K^T / sqrt(d) + bias) V (Correia et al. 2019, eq. 1 with softmax replaced)."""

    Options = EntmaxOptions
    supports_bias = True
    takes_padding_mask = True
    exposes_probabilities = True
    parallel_traits = ParallelTraits(tp="split_heads", cp=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        return self.probabilities(q, k, causal=causal, bias=bias, context=context) @ expand_kv(v, q.shape[1])

    def probabilities(self, q: Tensor, k: Tensor, *, causal: bool, bias: Tensor | None = None,
                      context: StepContext | None = None) -> Tensor:
        """dropout(alpha-entmax(Q K^T / sqrt(d) + bias)) (B, H, Tq, Tk)."""
        scores = q @ expand_kv(k, q.shape[1]).transpose(-1, -2) * q.shape[-1] ** -0.5
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if causal:
            scores = scores + causal_bias(q.shape[2], k.shape[2], q.device, scores.dtype)
        at_least_fp32 = scores.to(torch.promote_types(scores.dtype, torch.float32))
        probs = entmax(at_least_fp32, self.options.alpha, self.options.bisect_iterations).to(q.dtype)
        return self.dropout(probs, context)
