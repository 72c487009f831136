"""What every block kind (``model.block``) declares: the model settings and layouts it refuses, each with why.

A block kind is a ``TransformerBlock``-like module registered in :data:`~xscale.models.registry.BLOCK`; its class
carries ``block_traits`` (:class:`BlockTraits`) and, when it has settings, an ``Options`` dataclass. The checks in
:mod:`xscale.models.blocks.checks` read the traits, so refusing a layout never names a block class elsewhere.
"""

from __future__ import annotations

import dataclasses

from xscale.models.traits import Refusal


@dataclasses.dataclass(frozen=True)
class BlockTraits:
    """Each field names a setting and holds the :class:`Refusal` where the kind cannot take it (None: it can).

    ``tp``: ``parallel.tp > 1`` (the tensor-parallel plan splits what a kind's ``tensor_parallel_parts()`` names,
    :class:`~xscale.models.traits.BlockParts`; a kind with ``check_tensor_parallel(model, options, tp)`` also has
    its sizes checked against tp);
    ``selective_checkpointing``: ``parallel.activation_checkpointing=selective`` (it wraps ``attention.sublayer``'s
    core); ``other_stacks``: a ``model.stack`` other than plain (reversible, act and funnel run a block's parts
    themselves); ``encoder_decoder``: cross-attention blocks; ``segment_memory``: Transformer-XL's memory;
    ``carried_scores``: RealFormer's residual attention scores; ``share_layers``: one block at every depth;
    ``cp``: ``parallel.cp > 1`` (each rank holds a slice of the sequence: a kind that mixes neighbouring tokens outside
    its attention would read zeros at the slice's edges)."""

    tp: Refusal | None = None
    cp: Refusal | None = None
    selective_checkpointing: Refusal | None = None
    other_stacks: Refusal | None = None
    encoder_decoder: Refusal | None = None
    segment_memory: Refusal | None = None
    carried_scores: Refusal | None = None
    share_layers: Refusal | None = None

    def refusals(self) -> dict[str, Refusal]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}


STANDARD_TRAITS = BlockTraits()
OWN_ORDER = Refusal("model.stack=reversible, act and funnel run the standard block's attention and FFN "
                    "themselves, not this kind's order")
