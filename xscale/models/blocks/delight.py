"""DeLighT blocks (Mehta et al. 2021, "DeLighT: Deep and Light-weight Transformer", sec. 3): a deep, narrow
expand-reduce transformation before a single-head attention, and a light-weight FFN.

The DeLighT transformation maps the block's input X (width d_m) to d_o = d_m / 2 through N group linear
transformations (GLTs, eq. 1-2),

  Y^1 = GELU(F(X, W^1, b^1, g^1)),   Y^l = GELU(F(H(X, Y^{l-1}), W^l, b^l, g^l)),  l = 2..N  (no GELU after Y^N)
  F(Z, W, b, g) = [Z_1 W_1 ; ... ; Z_g W_g] + b   (Z cut into g groups along the features, W_k of (in/g) x (out/g))
  H(X, Y) = [X_1 ; S(Y)_1 ; ... ; X_g ; S(Y)_g]   (input mixing: X and the shuffled Y each cut into g^l groups)
  S(Y): feature shuffling, Y viewed as (g^{l-1}, out/g^{l-1}) and transposed, so each group of layer l reads
  features of every group of layer l-1
  g^l = min(2^{l-1}, g_max) for l <= ceil(N/2), g^l = g^{N+1-l} after (expand, then reduce, symmetric)

the first ceil(N/2) layers widening linearly from d_m to w_m d_m, the others narrowing linearly to d_o. The
attention is one head on d_o (queries, keys and values d_o -> d_o, its output d_o -> d_m); the FFN is light-weight,
d_m -> d_m / r -> d_m (r = 4: a reduction, not the usual expansion). Block-wise scaling (eq. 4) gives block b of B
its depth and width multiplier,

  N^b = N_min + (N_max - N_min) b / (B - 1),   w_m^b = w_m + (N_max - N_min) b / (N_min (B - 1))

so blocks near the input are shallow and narrow, those near the output deep and wide. A block learns its index b
from the layer index every block kind is built with (as Admin's omega reads it), so DeLighT is a block kind
(``model.block=delight``), not a stack: the stack, positions, residual placement and norms stay the model's.

Departures: N^b is rounded down (the paper leaves it real); each GLT output width is rounded up to a multiple of
its and the next layer's groups; there is no LayerNorm inside the transformation and no input or output projection
around it (the authors' code has both); g_max is an option (the paper ties it to d_m); encoder-decoder models are
refused (the paper's decoder blocks, with their cross-attention, are not built).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.block import TransformerBlock
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.ffn import build_ffn
from xscale.models.position import PositionEncoding
from xscale.models.registry import ATTENTION, BLOCK, POSITION
from xscale.models.traits import Refusal
from xscale.runtime import StepContext


@dataclasses.dataclass
class DelightOptions:
    min_depth: int = dataclasses.field(default=4, metadata={"help": "N_min, GLT layers of the first block"})
    max_depth: int = dataclasses.field(default=8, metadata={"help": "N_max, GLT layers of the last block"})
    width_multiplier: float = dataclasses.field(default=2.0, metadata={
        "help": "w_m, the first block's widest GLT layer over d_m (later blocks wider, eq. 4)"})
    max_groups: int = dataclasses.field(default=8, metadata={"help": "g_max, the most groups a GLT layer has"})
    ffn_reduction: int = dataclasses.field(default=4, metadata={"help": "r, the light-weight FFN's d_m / hidden"})

    def __post_init__(self) -> None:
        if not 1 <= self.min_depth <= self.max_depth:
            raise ConfigError(f"model.block.options: need 1 <= min_depth <= max_depth, got min_depth={self.min_depth}"
                              f" and max_depth={self.max_depth}")
        if self.width_multiplier < 1:
            raise ConfigError(f"model.block.options.width_multiplier={self.width_multiplier} must be >= 1 (the "
                              "transformation expands before it reduces)")
        if self.max_groups < 1 or self.max_groups & (self.max_groups - 1):
            raise ConfigError(f"model.block.options.max_groups={self.max_groups} must be a power of two")
        if self.ffn_reduction < 1:
            raise ConfigError(f"model.block.options.ffn_reduction={self.ffn_reduction} must be >= 1")


def block_scaling(options: DelightOptions, block: int, blocks: int) -> tuple[int, float]:
    """(N^b, w_m^b) of block ``block`` of ``blocks`` (eq. 4; N^b rounded down)."""
    share = block / (blocks - 1) if blocks > 1 else 0.0
    spread = options.max_depth - options.min_depth
    return options.min_depth + math.floor(spread * share), options.width_multiplier + spread * share / options.min_depth


def glt_groups(depth: int, max_groups: int) -> list[int]:
    """g^l for l = 1..N: doubling from 1 up to g_max over the first ceil(N/2) layers, mirrored after."""
    expanding = [min(2 ** layer, max_groups) for layer in range(math.ceil(depth / 2))]
    return expanding + expanding[::-1][depth % 2:]


def glt_widths(d_model: int, d_out: int, depth: int, width_multiplier: float, groups: list[int]) -> list[int]:
    """Each GLT layer's output width: linear from d_m up to w_m d_m at layer ceil(N/2), then down to d_o; every
    width but the last rounded up to a multiple of its and the next layer's groups."""
    middle, widest = math.ceil(depth / 2), width_multiplier * d_model
    widths = []
    for layer in range(1, depth + 1):
        if layer == depth:
            widths.append(d_out)
            continue
        if layer <= middle:
            target = d_model + (widest - d_model) * layer / middle
        else:
            target = widest + (d_out - widest) * (layer - middle) / (depth - middle)
        multiple = max(groups[layer - 1], groups[layer])
        widths.append(multiple * math.ceil(target / multiple))
    return widths


class GroupLinear(nn.Module):
    """F(Z, W, b, g) of the module docstring: one (in/g) x (out/g) linear map per group of features."""

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool) -> None:
        super().__init__()
        if in_features % groups or out_features % groups:
            raise ValueError(f"a GLT of {groups} groups needs widths divisible by it, got {in_features} -> "
                             f"{out_features}")
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups, in_features // groups, out_features // groups))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if not self.weight.is_meta:  # built by build_model, the weights are set by name (xscale.models.init)
            nn.init.normal_(self.weight, std=in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.unflatten(-1, (self.groups, -1))
        out = torch.einsum("...gi,gio->...go", grouped, self.weight.to(x.dtype)).flatten(-2)
        return out if self.bias is None else out + self.bias.to(x.dtype)


def shuffle_features(y: torch.Tensor, groups: int) -> torch.Tensor:
    """S(Y): the (groups, width/groups) features transposed, so consecutive features come from different groups."""
    return y.unflatten(-1, (groups, -1)).transpose(-1, -2).flatten(-2)


def mix_input(x: torch.Tensor, y: torch.Tensor, groups: int) -> torch.Tensor:
    """H(X, Y): group k of the result is group k of X followed by group k of Y."""
    return torch.cat([x.unflatten(-1, (groups, -1)), y.unflatten(-1, (groups, -1))], dim=-1).flatten(-2)


class DelightTransformation(nn.Module):
    """The expand-reduce stack of GLTs with feature shuffling and input mixing, d_m -> d_o (module docstring)."""

    def __init__(self, d_model: int, d_out: int, depth: int, width_multiplier: float, max_groups: int,
                 bias: bool) -> None:
        super().__init__()
        self.groups = glt_groups(depth, max_groups)
        widths = glt_widths(d_model, d_out, depth, width_multiplier, self.groups)
        inputs = [d_model] + [width + d_model for width in widths[:-1]]
        self.layers = nn.ModuleList(GroupLinear(n_in, n_out, groups, bias)
                                    for n_in, n_out, groups in zip(inputs, widths, self.groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers[0](x)
        for layer, (before, groups) in enumerate(zip(self.groups, self.groups[1:]), start=1):
            y = F.gelu(y)
            y = self.layers[layer](mix_input(x, shuffle_features(y, before), groups))
        return y


class DelightAttention(nn.Module):
    """Single-head attention on the DeLighT transformation's d_o features, its output mapped back to d_m."""

    def __init__(self, config: ModelConfig, layer_index: int, options: DelightOptions, **kwargs) -> None:
        super().__init__()
        d_out = config.d_model // 2
        depth, width = block_scaling(options, layer_index, config.n_layers)
        self.transformation = DelightTransformation(config.d_model, d_out, depth, width, options.max_groups,
                                                    config.bias)
        narrow = dataclasses.replace(config, d_model=d_out, n_heads=1, n_kv_heads=None)
        self.attention = Attention(narrow, layer_index, **kwargs)
        self.attention.wo = nn.Linear(d_out, config.d_model, bias=config.bias)

    @property
    def core(self) -> nn.Module:
        return self.attention.core

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None,
                context: StepContext | None = None) -> torch.Tensor:
        return self.attention(self.transformation(x), position, context=context)


@BLOCK.register("delight")
class DelightBlock(TransformerBlock):
    """The standard block's residuals around DeLighT's attention and light-weight FFN (module docstring)."""

    Options = DelightOptions
    block_traits = BlockTraits(
        tp=Refusal("DeLighT's attention is a single head, which tensor parallelism cannot split, and its group "
                   "linear transformations have no tp plan"),
        other_stacks=OWN_ORDER,
        selective_checkpointing=Refusal("selective recomputation wraps an attention core, and DeLighT's sits behind "
                                        "its transformation; use parallel.activation_checkpointing=full"),
        segment_memory=Refusal("Transformer-XL's memory is kept at d_m, DeLighT's attention reads d_o features"),
        carried_scores=Refusal("DeLighT's single head carries no RealFormer scores"),
        share_layers=Refusal("block-wise scaling gives every depth its own depth and width"),
        encoder_decoder=Refusal("the paper's decoder blocks with their cross-attention are not built"))

    def self_attention(self, config: ModelConfig, layer_index: int, **kwargs) -> nn.Module:
        return DelightAttention(config, layer_index, self.options or DelightOptions(), **kwargs)

    def feed_forward_sublayer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        reduction = (self.options or DelightOptions()).ffn_reduction
        return build_ffn(config.ffn, config.d_model, config.d_model // reduction, config.bias, config.dropout)

    @classmethod
    def check(cls, model: ModelConfig, options: DelightOptions) -> None:
        where = "model.block=delight"
        if model.d_model % (2 * options.max_groups) or model.d_model % options.ffn_reduction:
            raise ConfigError(f"{where}: model.d_model={model.d_model} must be a multiple of 2 x max_groups="
                              f"{2 * options.max_groups} (d_o = d_m / 2 and the GLT groups) and of ffn_reduction="
                              f"{options.ffn_reduction}; change it or the options")
        position = model.position.kind
        if position != "none" and position in POSITION.names() and not POSITION.get(position).adds_to_input:
            raise ConfigError(f"{where}: its single head reads d_o = d_m / 2 features, which model.position="
                              f"{position}'s per-head terms are not built for; use learned, sinusoidal, "
                              "learned_frequency or none")
        kinds = model.attention.per_layer or [model.attention.kind]
        if any(kind in ATTENTION.names() and ATTENTION.get(kind) is not ATTENTION.get("dense") for kind in kinds):
            raise ConfigError(f"{where}: the paper's attention is one dense head; set model.attention.kind=dense "
                              f"(it is {', '.join(kinds)})")
        if model.moe.num_experts:
            raise ConfigError(f"{where} has a light-weight FFN in every block; set model.moe.num_experts=0")
        if model.norm_placement == "deepnorm":
            raise ConfigError(f"{where}: DeepNorm's init does not know the GLTs; choose another model.norm_placement")
