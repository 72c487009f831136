"""Talking-heads attention (Shazeer et al. 2020): learned H x H maps mix the heads' logits before the
softmax and their weights after it.

  J = Q K^T / sqrt(d);  J'_g = sum_h J_h P_l[h, g] (+ bias, mask);  W = softmax(J');  W'_g = sum_h W_h P_w[h, g];
  out_g = W'_g V_g.
P = I + Delta with Delta learned and near 0 at initialisation, so the layer starts as dense attention. It mixes
heads, so a tensor-parallel plan that splits heads must refuse it (``mixes_heads``). Cost T^2 per head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xscale.config import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.registry import ATTENTION


@ATTENTION.register("talking_heads")
class TalkingHeadsAttention(AttentionCore):
    supports_bias = True
    mixes_heads = True

    def __init__(self, model: ModelConfig, layer_index: int, options) -> None:
        super().__init__(model, layer_index, options)
        self.pre_softmax_mix_delta = nn.Parameter(torch.zeros(model.n_heads, model.n_heads))
        self.post_softmax_mix_delta = nn.Parameter(torch.zeros(model.n_heads, model.n_heads))

    @staticmethod
    def _mix(x: Tensor, delta: Tensor) -> Tensor:
        """x (B, H, Tq, Tk) -> sum_h x_h (I + delta)[h, g]."""
        return x + torch.einsum("bhqk,hg->bgqk", x, delta.to(x.dtype))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None) -> Tensor:
        check_heads(self, self.pre_softmax_mix_delta, q.shape[1])
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        logits = self._mix(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, self.pre_softmax_mix_delta)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        weights = self._mix(torch.softmax(logits, dim=-1), self.post_softmax_mix_delta)
        weights = self.dropout(weights)
        return weights @ v
