"""The block kinds (``model.block``), one file each, registered in :data:`~xscale.models.registry.BLOCK`: what a
block holds and in which order its sub-layers run. ``standard`` is :class:`xscale.models.block.TransformerBlock`."""

from __future__ import annotations

from torch import nn

import xscale.models.blocks.checks  # noqa: F401  (registers the block checks)
import xscale.models.blocks.delight  # noqa: F401  (each kind registers itself)
import xscale.models.blocks.evolved  # noqa: F401
import xscale.models.blocks.gtrxl  # noqa: F401
import xscale.models.blocks.lite  # noqa: F401
import xscale.models.blocks.macaron  # noqa: F401
import xscale.models.blocks.sandwich  # noqa: F401
import xscale.models.blocks.standard  # noqa: F401
from xscale.config.schema import ModelConfig
from xscale.models.registry import BLOCK


def build_block(config: ModelConfig, layer_index: int, **kwargs) -> nn.Module:
    """The block of kind ``model.block`` at ``layer_index`` (kwargs: causal, cross, uses_bias, mixes_values)."""
    return BLOCK.build(config.block, "model.block", config, layer_index, **kwargs)


__all__ = ["build_block"]
