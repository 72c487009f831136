"""ProbSparse self-attention (Zhou et al. 2021, "Informer", sec. 3.1): only the u "active" queries attend, the rest
take the mean of the values. A query's sparsity measurement over keys (eq. 4, its max-mean form),

  M(q_i, K) = max_j (q_i k_j^T / sqrt(d)) - (1 / L_K) sum_j q_i k_j^T / sqrt(d),

is computed on U = c ln L_K sampled keys; the u = c ln L_Q queries of largest M get softmax attention over every key
(eq. 3: A(Q, K, V) = softmax(Q_bar K^T / sqrt(d)) V, Q_bar those queries), every other query the mean of V (the
cumulative mean V_{<=i} when causal, where the paper's code takes a cumulative sum), c = ``factor``.

Departures: the U measurement keys are evenly spaced over the sequence instead of drawn at random (so every layout
measures alike); when causal, a query's measurement reads only the sampled keys it may see. Heads are independent
(tensor parallelism splits heads); the selection reads the whole sequence, so context parallelism runs it on the
gathered sequence. Attention dropout acts on the active rows, by their global (head, query, key).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class ProbSparseOptions:
    factor: int = dataclasses.field(default=5, metadata={"help": "c: c ln L active queries and c ln L measured keys"})

    def __post_init__(self) -> None:
        require_positive("probsparse", factor=self.factor)


def sample_count(factor: int, length: int) -> int:
    """min(L, c ceil(ln L))."""
    return min(length, factor * math.ceil(math.log(max(length, 2))))


def sparsity_measurement(q: Tensor, k: Tensor, factor: int, causal: bool) -> Tensor:
    """M(q_i, K) (B, H, Tq) on min(Tk, c ceil(ln Tk)) evenly spaced keys (the first included), over the sampled keys
    j <= i when causal."""
    sampled = torch.linspace(0, k.shape[2] - 1, sample_count(factor, k.shape[2]), device=k.device).round().long()
    scores = q @ k[:, :, sampled].transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, Tq, U)
    if not causal:
        return scores.amax(-1) - scores.sum(-1) / k.shape[2]
    visible = sampled[None, :] <= torch.arange(q.shape[2], device=q.device)[:, None]
    top = scores.masked_fill(~visible, float("-inf")).amax(-1)
    return top - scores.masked_fill(~visible, 0.0).sum(-1) / visible.sum(-1)


@ATTENTION.register("probsparse", "informer")
class ProbSparseAttention(AttentionCore):
    """Softmax attention for the c ln L queries of largest sparsity measurement, mean(V) for the rest."""

    Options = ProbSparseOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        length, keys = q.shape[2], k.shape[2]
        with torch.no_grad():
            measurement = sparsity_measurement(q, k, self.options.factor, causal)
            active = measurement.topk(sample_count(self.options.factor, length), dim=-1).indices  # (B, H, u)
        rows = active[..., None]
        scores = q.gather(2, rows.expand(-1, -1, -1, q.shape[-1])) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if causal:
            scores = scores.masked_fill(torch.arange(keys, device=q.device) > rows, float("-inf"))
        probs = self.drop_active(torch.softmax(scores, dim=-1), rows, length, context)
        if causal:
            lazy = v.cumsum(2) / torch.arange(1, length + 1, device=v.device, dtype=v.dtype)[:, None]
        else:
            lazy = v.mean(2, keepdim=True).expand(-1, -1, length, -1)
        return lazy.scatter(2, rows.expand(-1, -1, -1, v.shape[-1]), probs @ v)

    def drop_active(self, probs: Tensor, rows: Tensor, length: int, context: StepContext | None) -> Tensor:
        """Attention dropout on the active rows (B, H, u, Tk) by their global (head, query, key) in the
        (heads, ``length``, Tk) probabilities of the whole layer."""
        if not self.drops_probabilities:
            return probs
        heads, keys = probs.shape[1], probs.shape[-1]
        first = 0 if context is None else context.heads_held(self.model_config.n_heads).start
        head = torch.arange(first, first + heads, device=probs.device)[None, :, None, None]
        flat = (head * length + rows) * keys + torch.arange(keys, device=probs.device)
        return self.dropout.at_each(probs, flat.expand(probs.shape), context)
