"""The ``standard`` block (``model.block=standard``, the default): attention, cross-attention in a decoder of an
encoder-decoder, FFN, each in ``model.norm_placement`` (:class:`xscale.models.block.TransformerBlock`)."""

from __future__ import annotations

from xscale.models.block import TransformerBlock
from xscale.models.blocks.kind import STANDARD_TRAITS
from xscale.models.registry import BLOCK


@BLOCK.register("standard")
class StandardBlock(TransformerBlock):
    """x <- x + attention(norm(x)); x <- x + FFN(norm(x)) (pre placement; module docstring of
    :mod:`xscale.models.block` for the others). Its state dict is TransformerBlock's."""

    block_traits = STANDARD_TRAITS
