"""The language-model head: hidden states to vocabulary logits, logits = h W_out (+ b), W_out tied to the embedding
by default (Press & Wolf 2017); BERT's MLM head first transforms h (Devlin et al. 2019)."""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.norm import build_norm
from xscale.ops.reference import ACTIVATIONS


class LMHeadTransform(nn.Module):
    """BERT's MLM head transform: norm(act(x W + b)) before the vocabulary projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = "gelu" if config.ffn.kind in ("gelu", "relu") else "gelu_tanh"
        self.norm = build_norm(config.norm, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(ACTIVATIONS[self.activation](self.dense(x)))
