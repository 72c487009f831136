"""The token ids hash routing reads (Hash Layers, Roller et al. 2021): set around the blocks that see those tokens.

The model sets them for each stack it runs (an encoder-decoder's decoder layers get ``decoder_input_ids``), a
pipeline stage for the microbatch it runs, and activation checkpointing replays those of the forward it
recomputes, so a recomputation run after other microbatches' forwards routes its own tokens.
"""

from __future__ import annotations

import torch

_token_ids: torch.Tensor | None = None  # a global, not a ContextVar: autograd's device threads read it too


class routing_token_ids:  # noqa: N801  (used like contextlib's context managers)
    """Hash routers inside read ``token_ids`` [B, T] (the sequence their layer sees). Re-enterable: a recomputing
    backward may enter it more than once."""

    def __init__(self, token_ids: torch.Tensor | None) -> None:
        self.token_ids = token_ids
        self._previous: list[torch.Tensor | None] = []

    def __enter__(self) -> None:
        global _token_ids
        self._previous.append(_token_ids)
        _token_ids = self.token_ids

    def __exit__(self, *exc_info: object) -> None:
        global _token_ids
        _token_ids = self._previous.pop()


def current_routing_token_ids() -> torch.Tensor | None:
    return _token_ids
