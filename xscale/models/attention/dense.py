"""Dense scaled dot-product attention, softmax(QK^T / sqrt(d) + bias) V (Vaswani et al. 2017, eq. 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def causal_bias(q_len: int, k_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0 where key j <= query i (aligned at the end when k_len > q_len), -inf elsewhere."""
    offset = k_len - q_len
    allowed = torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + offset
    return torch.zeros(q_len, k_len, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))


@ATTENTION.register("dense", "mha", "mqa", "gqa")
class DenseAttention(AttentionCore):
    """Through ``scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has them).

    With attention dropout in training the probabilities are formed explicitly, so that their mask is a
    function of (sample, global head, query, key) like every dropout mask here; SDPA's fused dropout would
    draw from each rank's RNG (:mod:`xscale.models.dropout`).
    """

    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    exposes_probabilities = True
    attends_to_memory = True
    parallel_traits = ParallelTraits(tp="split_heads", cp=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                bias: torch.Tensor | None = None, context: StepContext | None = None) -> torch.Tensor:
        if self.drops_probabilities:
            return self.probabilities(q, k, causal=causal, bias=bias, context=context) @ expand_kv(v, q.shape[1])
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1)
        mask = bias.to(q.dtype)
        if causal:
            mask = mask + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, bias: torch.Tensor | None = None,
                      context: StepContext | None = None) -> torch.Tensor:
        """dropout(softmax(Q K^T / sqrt(d) + bias)), (B, H, Tq, Tk): the weights the forward applies to V."""
        scores = q @ expand_kv(k, q.shape[1]).transpose(-1, -2) * q.shape[-1] ** -0.5
        if bias is not None:
            scores = scores + bias.to(q.dtype)
        if causal:
            scores = scores + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        return self.dropout(torch.softmax(scores, dim=-1), context)
