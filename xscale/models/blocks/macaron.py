"""Macaron blocks (Lu et al. 2019, "Understanding and Improving Transformer From a Multi-Particle Dynamic System
Point of View", eq. 9): the FFN is split into two half steps around the attention,

  x <- x + 1/2 FFN_1(x);  x <- x + attention(x);  x <- x + 1/2 FFN_2(x)

each term inside the residual of ``model.norm_placement`` (pre: FFN_1(norm(x)), as Conformer uses it). The two
FFNs have their own weights (``feed_forward_first`` and ``feed_forward``), so a block holds one FFN more; tensor
parallelism splits both as it splits the standard block's FFN (each is a residual of ``residual_names``).
"""

from __future__ import annotations

import torch

from xscale.config.schema import ModelConfig
from xscale.models.block import Residual, TransformerBlock, build_feed_forward
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.registry import BLOCK
from xscale.runtime import StepContext

HALF_STEP = 0.5


@BLOCK.register("macaron")
class MacaronBlock(TransformerBlock):
    """The standard block with a half-step FFN before the attention and the closing FFN halved (module docstring)."""

    block_traits = BlockTraits(other_stacks=OWN_ORDER)

    @classmethod
    def residual_names(cls, cross: bool) -> tuple[str, ...]:
        return ("feed_forward_first", *super().residual_names(cross))

    def __init__(self, config: ModelConfig, layer_index: int, **kwargs) -> None:
        super().__init__(config, layer_index, **kwargs)
        in_decoder = self.cross_attention is not None
        self.feed_forward_first = Residual(config, build_feed_forward(config, layer_index), in_decoder,
                                           branch_scale=HALF_STEP)
        self.feed_forward.branch_scale = HALF_STEP

    def forward(self, x: torch.Tensor, *args, context: StepContext | None = None,
                **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.feed_forward_first(x, context=context)
        return super().forward(x, *args, context=context, **kwargs)
