"""Dense scaled dot-product attention, softmax(QK^T / sqrt(d) + bias) V (Vaswani et al. 2017, eq. 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.registry import ATTENTION


def causal_bias(q_len: int, k_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0 where key j <= query i (aligned at the end when k_len > q_len), -inf elsewhere."""
    offset = k_len - q_len
    allowed = torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + offset
    return torch.zeros(q_len, k_len, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))


@ATTENTION.register("dense", "mha", "mqa", "gqa")
class DenseAttention(AttentionCore):
    """Through ``scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has them)."""

    supports_bias = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        dropout = self.model_config.attention_dropout if self.training else 0.0
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1, dropout_p=dropout)
        mask = bias.to(q.dtype)
        if causal:
            mask = mask + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
