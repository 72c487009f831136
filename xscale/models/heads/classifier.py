"""Sequence classification head: pool the encoder's final hidden states, then one linear map to class logits.

Pooling ``cls``: the hidden state of the class token the data prepends at position 0 (BERT's [CLS], Devlin et al.
2019, sec. 3); ``mean``: the mean over the real tokens, padding excluded by the mask (as in LRA's encoders, Tay et
al. 2021); ``max``: the feature-wise max over the real tokens (Conneau et al. 2017, InferSent's max pooling), which
keeps a feature that only a few tokens carry (Pathfinder's two dots) at full strength where a mean divides it by T. Padded positions never reach the logits: attention takes no padded key and pooling reads no padded row.
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ModelConfig

POOLINGS = ("cls", "mean", "max")


def pool(hidden: torch.Tensor, padding_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """(B, T, D) hidden states -> (B, D): the first token's (``cls``), the masked mean (``mean``) or max (``max``)."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "max":
        if padding_mask is None:
            return hidden.amax(dim=1)
        return hidden.masked_fill(~padding_mask.unsqueeze(-1), torch.finfo(hidden.dtype).min).amax(dim=1)
    if pooling != "mean":
        raise ValueError(f"pooling '{pooling}' is not one of {', '.join(POOLINGS)}")
    if padding_mask is None:
        return hidden.mean(dim=1)
    weights = padding_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1)


class ClassificationHead(nn.Module):
    """logits = W pool(h) + b over ``num_classes`` classes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pooling = config.pooling
        self.linear = nn.Linear(config.d_model, config.num_classes)

    def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(pool(hidden, padding_mask, self.pooling))
