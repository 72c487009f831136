"""The token ids hash routing reads (Hash Layers, Roller et al. 2021): set around the blocks that see those tokens.

The model sets them for each stack it runs (an encoder-decoder's decoder layers get ``decoder_input_ids``), a
pipeline stage for the microbatch it runs, and activation checkpointing replays those of the forward it
recomputes, so a recomputation run after other microbatches' forwards routes its own tokens.
"""

from __future__ import annotations

import torch

from xscale.models.scoped import Scope, ScopedValue

_TOKEN_IDS: ScopedValue[torch.Tensor] = ScopedValue(recomputation="replay")


def routing_token_ids(token_ids: torch.Tensor | None) -> Scope[torch.Tensor]:
    """Hash routers inside read ``token_ids`` [B, T] (the sequence their layer sees)."""
    return _TOKEN_IDS.scope(token_ids)


def current_routing_token_ids() -> torch.Tensor | None:
    return _TOKEN_IDS.current
