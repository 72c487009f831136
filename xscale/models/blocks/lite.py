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

Tensor parallelism splits both halves: the attention half by its heads, the convolution half by channels as an FFN
is split by its hidden width (GLU's value and gate maps column-parallel, the closing linear map row-parallel), each
rank convolving its own channels with its own conv heads' kernels (``conv_heads`` a multiple of tp).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.block import TransformerBlock
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.position import PositionEncoding
from xscale.models.registry import BLOCK
from xscale.models.traits import BlockParts, ParallelTraits, Refusal
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
    """Depthwise convolution over tokens with H softmax-normalised kernels shared by channel groups (module docstring).
    The channels and kernels it holds are read from its input and ``kernel``: a tensor-parallel rank holds a slice
    of both."""

    def __init__(self, options: LiteOptions, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.kernel = nn.Parameter(torch.zeros(options.conv_heads, options.kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels, (heads, width) = x.shape[-1], self.kernel.shape
        weight = torch.softmax(self.kernel.float(), dim=-1).to(x.dtype)
        weight = weight.repeat_interleave(channels // heads, dim=0).unsqueeze(1)  # (C, 1, k)
        before = width - 1 if self.causal else (width - 1) // 2
        padded = F.pad(x.transpose(1, 2), (before, width - 1 - before))
        return F.conv1d(padded, weight, groups=channels).transpose(1, 2)


class ConvolutionBranch(nn.Module):
    """The short-range half: GLU(h) = (W_v h) * sigmoid(W_g h) to c channels, lightweight convolution, linear
    (c = d/2 channels)."""

    parallel_traits = ParallelTraits(tp="split_hidden", column_parallel=("w_value", "w_gate"), row_parallel=("w_out",),
                                     split_rows=("convolution.kernel",))

    def __init__(self, channels: int, options: LiteOptions, causal: bool, bias: bool) -> None:
        super().__init__()
        self.w_value = nn.Linear(channels, channels, bias=bias)
        self.w_gate = nn.Linear(channels, channels, bias=bias)
        self.convolution = LightweightConvolution(options, causal)
        self.w_out = nn.Linear(channels, channels, bias=bias)

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        x = self.w_value(x) * torch.sigmoid(self.w_gate(x))
        if context is not None and context.padding_mask is not None:
            x = x * context.padding_mask.unsqueeze(-1).to(x.dtype)
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
        return torch.cat([self.attention(globally, position, context=context),
                          self.branch(locally, context=context)], dim=-1)


@BLOCK.register("lite")
class LiteBlock(TransformerBlock):
    """The standard block with LSRA in place of the self-attention (module docstring)."""

    Options = LiteOptions
    block_traits = BlockTraits(
        other_stacks=OWN_ORDER,
        selective_checkpointing=Refusal("selective recomputation wraps an attention core, and LSRA's sits one "
                                        "module deeper; use parallel.activation_checkpointing=full"),
        segment_memory=Refusal("Transformer-XL's memory would need the convolution's past inputs too"),
        carried_scores=Refusal("LSRA returns one tensor, not RealFormer's scores beside it"),
        cp=Refusal("the convolution half reads kernel_size neighbouring tokens, which context parallelism puts on "
                   "another rank (no halo exchange is built: a cp=2 run differed from one process by 1%)"))

    def self_attention(self, config: ModelConfig, layer_index: int, **kwargs) -> nn.Module:
        return LongShortRangeAttention(config, layer_index, self.options or LiteOptions(), **kwargs)

    def tensor_parallel_parts(self) -> BlockParts:
        """The standard block's parts with LSRA's two halves in place of the self-attention (module docstring)."""
        parts = super().tensor_parallel_parts()
        return dataclasses.replace(parts, attentions=(*parts.attentions, "attention.sublayer.attention"),
                                   modules=tuple("attention.sublayer.branch" if path == "attention.sublayer" else path
                                                 for path in parts.modules))

    @classmethod
    def check_tensor_parallel(cls, model: ModelConfig, options: LiteOptions, tp: int) -> None:
        """The attention half's n_heads/2 heads (and kv heads) and the conv heads split over ``tp`` ranks."""
        where = f"model.block=lite under parallel.tp={tp}"
        half_heads, half_kv_heads = model.n_heads // 2, model.kv_heads // 2
        if half_heads % tp or (half_kv_heads != 1 and half_kv_heads % tp):
            raise ConfigError(f"{where} splits the attention half's n_heads/2={half_heads} heads and "
                              f"n_kv_heads/2={half_kv_heads} kv heads over the ranks: make model.n_heads and "
                              f"model.n_kv_heads multiples of {2 * tp} (or model.n_kv_heads=2: one kv head, replicated)")
        if options.conv_heads % tp:
            raise ConfigError(f"{where} gives each rank its channels of the convolution with their kernels: make "
                              f"model.block.options.conv_heads={options.conv_heads} a multiple of {tp}")

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
