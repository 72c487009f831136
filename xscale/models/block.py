"""One Transformer layer: self-attention, optional cross-attention, FFN (or MoE), with residual norms.

Placement (Xiong et al. 2020; Ding et al. 2021 for sandwich):
  post:     x = norm(x + f(x))
  pre:      x = x + f(norm(x))
  sandwich: x = x + norm_out(f(norm_in(x)))
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config import ModelConfig
from xscale.models.attention import Attention
from xscale.models.ffn import build_ffn
from xscale.models.norm import build_norm
from xscale.models.position import PositionEncoding


class Residual(nn.Module):
    """A sub-layer with its norm(s), dropout and residual connection, in the configured placement."""

    def __init__(self, config: ModelConfig, sublayer: nn.Module) -> None:
        super().__init__()
        self.placement = config.norm_placement
        self.sublayer = sublayer
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)
        if self.placement == "sandwich":
            self.norm_out = build_norm(config.norm, config.d_model, config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.placement == "post":
            return self.norm(x + self.dropout(self.sublayer(x, *args, **kwargs)))
        out = self.sublayer(self.norm(x), *args, **kwargs)
        if self.placement == "sandwich":
            out = self.norm_out(out)
        return x + self.dropout(out)


def build_feed_forward(config: ModelConfig, layer_index: int) -> nn.Module:
    if config.moe.is_moe_layer(layer_index):
        from xscale.models.moe import build_moe

        return build_moe(config, layer_index)
    return build_ffn(config.ffn, config.d_model, config.ffn_hidden, config.bias, config.dropout)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, causal: bool, cross: bool = False,
                 uses_bias: bool = False) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attention = Residual(config, Attention(config, layer_index, causal=causal, uses_bias=uses_bias))
        self.cross_attention = (
            Residual(config, Attention(config, layer_index, causal=False, cross=True)) if cross else None
        )
        self.feed_forward = Residual(config, build_feed_forward(config, layer_index))

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention(x, position)
        if self.cross_attention is not None:
            x = self.cross_attention(x, None, memory)
        return self.feed_forward(x)
