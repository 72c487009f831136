"""Talking-heads attention (Shazeer et al. 2020): learned H x H maps mix the heads' logits before the
softmax and their weights after it.

  J = Q K^T / sqrt(d);  J'_g = sum_h J_h P_l[h, g] (+ bias, mask);  W = softmax(J');  W'_g = sum_h W_h P_w[h, g];
  out_g = W'_g V_g.
P = I + Delta with Delta learned and near 0 at initialisation, so the layer starts as dense attention. It mixes
heads (``mixes_heads``): a rank holding some heads cannot compute their output from them alone; tensor
parallelism (``tp="gather_heads"``) gives the core every head's queries and keys and has it compute the heads its context names (``StepContext.heads_held``), its
own output heads (:mod:`xscale.parallel.tensor.talking_heads`). Cost T^2 per head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@ATTENTION.register("talking_heads")
class TalkingHeadsAttention(AttentionCore):
    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    mixes_heads = True
    parallel_traits = ParallelTraits(tp="gather_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options) -> None:
        super().__init__(model, layer_index, options)
        self.pre_softmax_mix_delta = nn.Parameter(torch.zeros(model.n_heads, model.n_heads))
        self.post_softmax_mix_delta = nn.Parameter(torch.zeros(model.n_heads, model.n_heads))

    @staticmethod
    def _mix(x: Tensor, delta: Tensor, heads: slice = slice(None)) -> Tensor:
        """x (B, H, Tq, Tk) -> sum_h x_h (I + delta)[h, g] for the output heads g in ``heads``."""
        return x[:, heads] + torch.einsum("bhqk,hg->bgqk", x, delta[:, heads].to(x.dtype))

    def softmax_weights(self, q: Tensor, k: Tensor, *, causal: bool, bias: Tensor | None = None) -> Tensor:
        """W = softmax(J P_l + bias + mask) (B, H, Tq, Tk) from every head's q (B, H, Tq, d) and k."""
        check_heads(self, self.pre_softmax_mix_delta, q.shape[1])
        k = expand_kv(k, q.shape[1])
        logits = self._mix(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, self.pre_softmax_mix_delta)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        return torch.softmax(logits, dim=-1)

    def attend_heads(self, weights: Tensor, v: Tensor, heads: slice = slice(None),
                     context: StepContext | None = None) -> Tensor:
        """out_g = dropout(W'_g) V_g for the output heads g in ``heads``, from every head's W and their v."""
        mixed = self.dropout(self._mix(weights, self.post_softmax_mix_delta, heads), context)
        return mixed @ expand_kv(v, mixed.shape[1])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        # The output heads g this core computes: all of them on one device, a tensor-parallel rank's slice.
        heads = slice(None) if context is None else context.heads_held(q.shape[1])
        return self.attend_heads(self.softmax_weights(q, k, causal=causal, bias=bias), v, heads, context)
