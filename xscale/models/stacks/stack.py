"""A stack of Transformer blocks: what every stack variant (``model.stack``) shares.

A stack holds its blocks in a ``ModuleDict`` keyed by depth (``layers.0``, ``layers.1``, ...), its own position
encoding and, for the pre/sandwich placements, a final norm. ``held``: the depths [first, stop) whose blocks this
module runs (all of them, or a pipeline stage's run, :meth:`Stack.keep`). With ``model.share_layers`` (ALBERT,
Lan et al. 2020) one block, ``layers.0``, runs at every held depth and draws its own dropout masks at each (the
context's ``depth``).

A variant subclasses :class:`Stack`, overrides :meth:`Stack.run` (how the held blocks are applied), declares its
``stack_traits`` (the layouts it refuses, :class:`~xscale.models.traits.StackTraits`) and its ``Options``, and
registers itself in :data:`~xscale.models.registry.STACK` (docs/extending.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from xscale.config.schema import Config, ModelConfig
from xscale.models.block import PRE_NORM_PLACEMENTS
from xscale.models.blocks import build_block
from xscale.models.norm import build_norm
from xscale.models.position import PositionEncoding, TappedPosition, build_position
from xscale.models.registry import ATTENTION, NoOptions
from xscale.models.traits import StackTraits
from xscale.runtime import StepContext


def carrying_kinds(model: ModelConfig) -> list[str]:
    """The attention kinds of ``model`` that carry RealFormer scores from layer to layer (He et al. 2020)."""
    return sorted({kind for kind in model.attention.per_layer or [model.attention.kind]
                   if kind in ATTENTION.names() and ATTENTION.get(kind).carries_scores})


class Stack(nn.Module):
    """The blocks of one stack with its position encoding and final norm (module docstring)."""

    stack_traits = StackTraits()
    # Whether the variant reads every layer's output (the early-exit classifier's exits).
    keeps_layer_states = False
    # Whether a decoder can feed it one new token at a time over a KV cache (else generation runs the whole prefix).
    decodes_from_cache = True

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: Any = None) -> None:
        super().__init__()
        self.options = NoOptions() if options is None else options
        self.n_layers = n_layers
        self.held = (0, n_layers)
        self.share_layers = config.share_layers
        self.position: PositionEncoding | None = build_position(
            config.position, config.d_model, config.n_heads, config.head_dim, config.max_seq_len, causal)
        uses_bias = self.position.biases_logits or self.position.biases_from_content
        built = 1 if config.share_layers else n_layers + self.extra_blocks(config, self.options)
        self.layers = nn.ModuleDict({
            str(i): build_block(config, first_index + i, causal=causal, cross=cross, uses_bias=uses_bias,
                                mixes_values=self.position.mixes_values)
            for i in range(built)
        })
        self.final_norm = (
            build_norm(config.norm, config.d_model)
            if config.norm_placement in PRE_NORM_PLACEMENTS else None
        )
        # Depths whose blocks take and pass on RealFormer scores (the whole stack's, kept when a stage is cut).
        self.carrying = tuple(depth for depth, block in zip(range(n_layers), self.blocks()) if block.carries_scores)

    @classmethod
    def check(cls, config: Config, options: Any) -> None:
        """Refuse the model options this variant cannot run with, each with what to change (none here)."""

    @classmethod
    def extra_blocks(cls, config: ModelConfig, options: Any) -> int:
        """Blocks built after the ``n_layers`` the variant runs by depth (a funnel's decoder blocks)."""
        return 0

    @classmethod
    def loss_positions(cls, config: ModelConfig, options: Any) -> int:
        """How many last positions the stack's output holds, the only ones the loss can read (0: every one)."""
        return 0

    @classmethod
    def sequence_divisor(cls, config: ModelConfig, options: Any) -> int:
        """What each context-parallel chunk's length must be a multiple of (a funnel halves the sequence)."""
        return 1

    @property
    def depths(self) -> range:
        return range(*self.held)

    @property
    def starts(self) -> bool:
        """Whether the stack's first block is held here (its input is the embedded tokens)."""
        return self.held[0] == 0

    @property
    def ends(self) -> bool:
        """Whether the stack's last block is held here (its final norm follows)."""
        return self.held[1] == self.n_layers

    def blocks(self) -> list[nn.Module]:
        """The held blocks in execution order (one block repeated when weights are shared)."""
        if self.share_layers:
            return [self.layers["0"]] * len(self.depths)
        return list(self.layers.values())

    def scores_cross(self, boundary: int) -> bool:
        """Whether RealFormer scores cross the boundary before depth ``boundary``: a carrying block on each side."""
        return any(d < boundary for d in self.carrying) and any(d >= boundary for d in self.carrying)

    def keep(self, depths: range) -> None:
        """Delete every block outside ``depths`` (a pipeline stage's run), the final norm unless the run ends the
        stack, and an absolute position table unless it starts it (positions are added once, before the first)."""
        kept = {"0"} if self.share_layers else {str(depth) for depth in depths}
        for name in [name for name in self.layers if name not in kept]:
            del self.layers[name]
        self.held = (depths.start, depths.stop)
        if not self.ends:
            self.final_norm = None
        if not self.starts and self.position is not None and self.position.adds_to_input:
            self.position = None

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the stack's output (a funnel's is pooled)."""
        return mask

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, scores: torch.Tensor | None,
                context: StepContext,
                layer_states: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the held blocks; returns (x, scores), ``scores`` being the RealFormer scores that
        ``carries_scores`` blocks pass on (other blocks leave them as they are). ``layer_states``: a list that
        receives each block's output (:attr:`keeps_layer_states`)."""
        position = self.position
        if position is not None and not self.starts:
            position = TappedPosition.around(position, x)
        return self.run(x, position, memory, scores, context, layer_states)

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The held blocks one after the other: x <- block(x) at each depth."""
        for depth, block in zip(self.depths, self.blocks()):
            x, scores = self.run_block(depth, block, x, position, memory, scores, context)
            if layer_states is not None:
                layer_states.append(x)
        return x, scores

    def run_depth(self, depth: int, x: torch.Tensor, scores: torch.Tensor | None,
                  context: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``depth`` alone, as the plain loop runs it, in a whole stack (realised early exit runs the stack
        layer by layer on fewer and fewer rows)."""
        return self.run_block(depth, self.blocks()[depth], x, self.position, None, scores, context)

    def block_context(self, depth: int, context: StepContext) -> StepContext:
        """A shared block draws its own dropout masks at each depth."""
        return context.at_depth(depth) if self.share_layers else context

    def run_block(self, depth: int, block: nn.Module, x: torch.Tensor, position: PositionEncoding | None,
                  memory: torch.Tensor | None, scores: torch.Tensor | None,
                  context: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        block_context = self.block_context(depth, context)
        if block.carries_scores:
            return block(x, position, memory, scores=scores, context=block_context)
        return block(x, position, memory, context=block_context), scores
