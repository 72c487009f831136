"""Lite Transformer blocks (Wu et al. 2020, "Lite Transformer with Long-Short Range Attention", sec. 3): the
attention sub-layer is Long-Short Range Attention (LSRA), the input split in two halves by channels,

  LSRA(x) = [ attention(x_1) ; convolution(x_2) ],  x = [x_1 ; x_2]  (each of width d/2)

the attention half (global context) with n_heads/2 heads of the usual head size, the convolution half (local
context) GLU, then a lightweight convolution, then a linear map (Wu et al. 2019, "Pay Less Attention", eq. 3):

  LightConv(x)_{t,c} = sum_{j=0}^{k-1} softmax(W_{h(c)})_j x_{t + j - p, c}

W in R^{H x k} one kernel per conv head, shared by the d/(2H) channels h(c) of the head, softmax-normalised over
the width; p = k - 1 (causal: only past tokens) or (k - 1) / 2 (centred) for an encoder. Padded tokens are zeroed
before the convolution. Departures: no DropConnect on the kernel, and the "flattened" FFN of the paper is not implied
(set ``model.d_ff`` for it); dynamic convolutions are not offered.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.block import TransformerBlock
from xscale.models.blocks.kind import OWN_ORDER, UNPLANNED_TP, BlockTraits
from xscale.models.position import PositionEncoding
from xscale.models.registry import BLOCK
from xscale.models.traits import Refusal
from xscale.runtime import StepContext

# Positions an attention half of n_heads/2 heads reads as the full model would (no per-head tables or biases).
HALF_WIDTH_POSITIONS = ("rope", "sinusoidal", "learned", "learned_frequency", "none")


@dataclasses.dataclass
class LiteOptions:
    kernel_size: int = dataclasses.field(default=7, metadata={"help": "k, the convolution's width in tokens"})
    conv_heads: int = dataclasses.field(default=4, metadata={
        "help": "H, kernels of the lightweight convolution (each shared by d/(2H) channels)"})

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.conv_heads < 1:
            raise ConfigError(f"model.block.options: kernel_size={self.kernel_size} and conv_heads={self.conv_heads} "
                              "must be >= 1")


class LightweightConvolution(nn.Module):
    """Depthwise convolution over tokens with H softmax-normalised kernels shared by channel groups (module docstring)."""

    def __init__(self, channels: int, options: LiteOptions, causal: bool) -> None:
        super().__init__()
        self.channels, self.heads, self.causal = channels, options.conv_heads, causal
        self.kernel = nn.Parameter(torch.zeros(options.conv_heads, options.kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.kernel.shape[1]
        weight = torch.softmax(self.kernel.float(), dim=-1).to(x.dtype)
        weight = weight.repeat_interleave(self.channels // self.heads, dim=0).unsqueeze(1)  # (C, 1, k)
        before = width - 1 if self.causal else (width - 1) // 2
        padded = F.pad(x.transpose(1, 2), (before, width - 1 - before))
        return F.conv1d(padded, weight, groups=self.channels).transpose(1, 2)


class ConvolutionBranch(nn.Module):
    """The short-range half: linear to 2c, GLU, lightweight convolution, linear (c = d/2 channels)."""

    def __init__(self, channels: int, options: LiteOptions, causal: bool, bias: bool) -> None:
        super().__init__()
        self.w_in = nn.Linear(channels, 2 * channels, bias=bias)
        self.convolution = LightweightConvolution(channels, options, causal)
        self.w_out = nn.Linear(channels, channels, bias=bias)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = F.glu(self.w_in(x), dim=-1)
        if padding_mask is not None:
            x = x * padding_mask.unsqueeze(-1).to(x.dtype)
        return self.w_out(self.convolution(x))


class LongShortRangeAttention(nn.Module):
    """LSRA (module docstring): ``attention`` on the first d/2 channels, ``branch`` on the rest, concatenated."""

    def __init__(self, config: ModelConfig, layer_index: int, options: LiteOptions, *, causal: bool,
                 uses_bias: bool, mixes_values: bool) -> None:
        super().__init__()
        half = dataclasses.replace(config, d_model=config.d_model // 2, n_heads=config.n_heads // 2,
                                   n_kv_heads=None if config.n_kv_heads is None else config.n_kv_heads // 2)
        self.attention = Attention(half, layer_index, causal=causal, uses_bias=uses_bias, mixes_values=mixes_values)
        self.branch = ConvolutionBranch(config.d_model // 2, options, causal, config.bias)

    @property
    def core(self) -> nn.Module:
        """The attention half's core (what the block asks whether it carries RealFormer scores)."""
        return self.attention.core

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None,
                context: StepContext | None = None) -> torch.Tensor:
        if context is not None and context.kv_cache is not None:
            raise ValueError("model.block=lite: incremental decoding would need the convolution's past inputs, which "
                             "the KV cache does not keep; generate with a standard block")
        globally, locally = x.chunk(2, dim=-1)
        padding_mask = None if context is None else context.padding_mask
        return torch.cat([self.attention(globally, position, context=context),
                          self.branch(locally, padding_mask)], dim=-1)


@BLOCK.register("lite")
class LiteBlock(TransformerBlock):
    """The standard block with LSRA in place of the self-attention (module docstring)."""

    Options = LiteOptions
    block_traits = BlockTraits(
        tp=UNPLANNED_TP, other_stacks=OWN_ORDER,
        selective_checkpointing=Refusal("selective recomputation wraps an attention core, and LSRA's sits one "
                                        "module deeper; use parallel.activation_checkpointing=full"),
        segment_memory=Refusal("Transformer-XL's memory would need the convolution's past inputs too"),
        carried_scores=Refusal("LSRA returns one tensor, not RealFormer's scores beside it"))

    def self_attention(self, config: ModelConfig, layer_index: int, **kwargs) -> nn.Module:
        return LongShortRangeAttention(config, layer_index, self.options or LiteOptions(), **kwargs)

    @classmethod
    def check(cls, model: ModelConfig, options: LiteOptions) -> None:
        where = "model.block=lite"
        if model.n_heads % 2 or model.d_model % 2 or (model.n_kv_heads or 2) % 2:
            raise ConfigError(f"{where} gives half the heads to each branch: make model.n_heads={model.n_heads}, "
                              f"model.n_kv_heads and model.d_model={model.d_model} even")
        if (model.d_model // 2) % options.conv_heads:
            raise ConfigError(f"{where}: the convolution's {model.d_model // 2} channels do not split into "
                              f"conv_heads={options.conv_heads} kernels; choose a divisor of {model.d_model // 2}")
        if model.position.kind not in HALF_WIDTH_POSITIONS:
            raise ConfigError(f"{where}: model.position={model.position.kind} keeps per-head or full-width tables "
                              f"the half-width attention cannot read; use one of {', '.join(HALF_WIDTH_POSITIONS)}")
        if model.norm_placement == "deepnorm":
            raise ConfigError(f"{where}: DeepNorm's init does not know LSRA's projections; choose another "
                              "model.norm_placement")
