"""Sandwich Transformer orderings (Press et al. 2020, "Improving Transformer Models by Reordering their
Sublayers", sec. 4): the 2n sub-layers of an n-layer stack, n attention (s) and n FFN (f), run in the order a
pattern spells, e.g. for sandwich coefficient k

  s^k (sf)^(n-k) f^k        (k = 0: the interleaved sfsf...sf of the standard model)

and each sub-layer keeps its residual in ``model.norm_placement``. Not Sandwich-LN (``model.norm_placement=
sandwich``, Ding et al. 2021), which adds norms around a sub-layer. Block l runs characters [2l, 2l + 2) of the
pattern, so each block holds two sub-layers and the parameter count equals the standard model's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.block import Residual, build_feed_forward, residual_parts
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.position import PositionEncoding
from xscale.models.registry import BLOCK
from xscale.models.traits import BlockParts, Refusal
from xscale.runtime import StepContext

SUBLAYERS_PER_BLOCK = 2


def sandwich_pattern(options: SandwichOptions, n_layers: int) -> str:
    """The whole stack's order: ``options.pattern`` as given, else s^k (sf)^(n-k) f^k for k = coefficient."""
    if options.pattern:
        return options.pattern
    k = options.coefficient
    if k > n_layers:
        raise ConfigError(f"model.block.options.coefficient={k} must be at most model.n_layers={n_layers} "
                          "(k in s^k (sf)^(n-k) f^k)")
    return "s" * k + "sf" * (n_layers - k) + "f" * k


def check_sandwich_pattern(pattern: str, n_layers: int, where: str) -> None:
    """One line saying what is wrong with ``pattern`` for an ``n_layers`` stack, and how to fix it."""
    if set(pattern) - {"s", "f"}:
        raise ConfigError(f"{where}={pattern!r} may hold only 's' (attention) and 'f' (FFN); e.g. 'ssfsff'")
    if len(pattern) != SUBLAYERS_PER_BLOCK * n_layers or pattern.count("s") != n_layers:
        raise ConfigError(f"{where}={pattern!r} must have {n_layers} 's' and {n_layers} 'f' (2 x model.n_layers="
                          f"{n_layers} sub-layers, as many of each as the standard model); got "
                          f"{pattern.count('s')} and {pattern.count('f')}")


@dataclasses.dataclass
class SandwichOptions:
    pattern: str = dataclasses.field(default="", metadata={
        "help": "the stack's order of s (attention) and f (FFN), n of each; empty: from the coefficient"})
    coefficient: int = dataclasses.field(default=1, metadata={
        "help": "k in s^k (sf)^(n-k) f^k (0 <= k <= n_layers)"})

    def __post_init__(self) -> None:
        if self.coefficient < 0:
            raise ConfigError(f"model.block.options.coefficient={self.coefficient} must be >= 0 (k in "
                              "s^k (sf)^(n-k) f^k)")


@BLOCK.register("sandwich")
class SandwichBlock(nn.Module):
    """Two sub-layers, each an attention or an FFN residual, in the pattern's order (module docstring). They are
    ``sublayers.0`` and ``sublayers.1``, so an 'ss' or 'ff' block has no ``attention`` or ``feed_forward``."""

    Options = SandwichOptions
    block_traits = BlockTraits(
        other_stacks=OWN_ORDER,
        selective_checkpointing=Refusal("selective recomputation wraps each block's attention core, and an 'ff' "
                                        "block has none; use parallel.activation_checkpointing=full"),
        encoder_decoder=Refusal("the paper reorders a decoder-only language model's sub-layers; cross-attention has "
                                "no place in the pattern"),
        segment_memory=Refusal("Transformer-XL's memory remembers each block's attention input, and an 'ff' block "
                               "has none"),
        carried_scores=Refusal("RealFormer's scores pass from attention to attention through every block"),
        share_layers=Refusal("each depth runs its own two characters of the pattern, so blocks differ by depth"))
    carries_scores = False
    compression = None

    @classmethod
    def residual_names(cls, cross: bool) -> tuple[str, ...]:
        return tuple(f"sublayers.{index}" for index in range(SUBLAYERS_PER_BLOCK))

    @classmethod
    def check(cls, model: ModelConfig, options: SandwichOptions) -> None:
        check_sandwich_pattern(sandwich_pattern(options, model.n_layers), model.n_layers,
                               "model.block.options.pattern")

    def __init__(self, config: ModelConfig, layer_index: int, *, causal: bool, cross: bool = False,
                 uses_bias: bool = False, mixes_values: bool = False, options: SandwichOptions | None = None) -> None:
        super().__init__()
        options = SandwichOptions() if options is None else options
        self.layer_index = layer_index
        pattern = sandwich_pattern(options, config.n_layers)
        check_sandwich_pattern(pattern, config.n_layers, "model.block.options.pattern")
        self.order = pattern[SUBLAYERS_PER_BLOCK * layer_index: SUBLAYERS_PER_BLOCK * (layer_index + 1)]
        self.sublayers = nn.ModuleList(
            Residual(config, Attention(config, layer_index, causal=causal, uses_bias=uses_bias,
                                       mixes_values=mixes_values))
            if kind == "s" else Residual(config, build_feed_forward(config, layer_index))
            for kind in self.order)

    def tensor_parallel_parts(self) -> BlockParts:
        """Each sub-layer split as the standard block's of its kind (attention by heads, FFN by hidden width)."""
        return residual_parts(self, self.residual_names(cross=False))

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None, memory: torch.Tensor | None = None,
                context: StepContext | None = None) -> torch.Tensor:
        for kind, residual in zip(self.order, self.sublayers):
            x = residual(x, position, context=context) if kind == "s" else residual(x, context=context)
        return x
