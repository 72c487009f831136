"""RealFormer residual attention (He et al. 2020): each layer adds the previous layer's pre-softmax
scores to its own, S_l = Q_l K_l^T / sqrt(d) + S_{l-1}, and attends with softmax(S_l + bias + mask) V_l.

The carried S_l holds neither the position bias (added again by every layer, so ALiBi does not accumulate)
nor the causal mask (re-applied by every layer). S_0 = 0, so the first layer is plain dense attention. The
scores are per head, so tensor parallelism splits them with the heads; between pipeline stages they travel
beside the hidden state (:class:`xscale.models.transformer.Stack`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@ATTENTION.register("realformer", "residual_attention")
class RealFormerAttention(AttentionCore):
    """Dense attention with residual scores: T^2 memory per layer for the carried (B, H, T, T) scores."""

    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    carries_scores = True
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None,
                previous_scores: Tensor | None = None) -> tuple[Tensor, Tensor]:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if previous_scores is not None:
            if previous_scores.shape != scores.shape:
                raise ValueError(f"realformer: the previous layer's scores have shape {tuple(previous_scores.shape)}, "
                                 f"this layer's {tuple(scores.shape)}; residual attention needs equal heads and "
                                 "lengths in every layer")
            scores = scores + previous_scores
        logits = scores
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        probs = torch.softmax(logits, dim=-1)
        probs = self.dropout(probs, context)
        return probs @ v, scores
