"""Where ``checkpoint.init_from`` weights come from: a registry of sources by prefix (``hf:DIR``), filled by the
layers that read foreign formats (:mod:`xscale.interop.hf.load` registers ``hf``) so the trainer imports none.

A source writes its weights into a (possibly sharded) model state dict, the one a checkpoint loads into; a source
that cannot read its location raises :class:`~xscale.checkpoint.integrity.CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xscale.checkpoint.integrity import CheckpointError
from xscale.config.schema import ModelConfig

# (model state dict, location after the prefix, the model's config) -> None
FillWeights = Callable[[dict[str, torch.Tensor], str, ModelConfig], None]
_SOURCES: dict[str, FillWeights] = {}
# The key of meta.json that marks a checkpoint holding the model's weights only (written from outside, step 0).
WEIGHTS_ONLY = "weights_only"


def register_init_source(prefix: str, fill: FillWeights) -> FillWeights:
    """Let ``checkpoint.init_from=PREFIX:LOCATION`` fill the model's state dict with ``fill``."""
    _SOURCES[prefix] = fill
    return fill


def init_source_prefix(init_from: str) -> str | None:
    """The prefix ``init_from`` names (``hf`` of ``hf:DIR``), or None for ``none``."""
    if init_from in ("", "none"):
        return None
    return init_from.split(":", 1)[0] if ":" in init_from else init_from


def fill_from_source(init_from: str, state: dict[str, torch.Tensor], model: ModelConfig) -> None:
    """Copy the weights ``init_from`` (``PREFIX:LOCATION``) names into ``state``; a prefix no layer registered is
    refused with the ones that are."""
    prefix = init_source_prefix(init_from)
    if prefix not in _SOURCES:
        known = ", ".join(f"{name}:" for name in _SOURCES) or "none (import xscale.interop.hf.load for hf:)"
        raise CheckpointError(f"checkpoint.init_from={init_from}: no weight source '{prefix}:' is registered; "
                              f"registered: {known}")
    _SOURCES[prefix](state, init_from[len(prefix) + 1:], model)
