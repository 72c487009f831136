"""Activation checkpointing (Chen et al. 2016): trade recomputation for activation memory.

``full`` recomputes every Transformer block in the backward pass; ``selective`` recomputes only the attention
cores (the softmax-sized activations, Korthikanti et al. 2022), keeping the cheap-to-store linear outputs. Wrappers
add ``_checkpoint_wrapped_module`` to parameter names; checkpoints and the initialiser strip it.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from xscale.models.attention.routing import routed_centroids
from xscale.models.dropout import (
    current_dropout_depth,
    current_dropout_position,
    dropout_depth,
    dropout_position,
)
from xscale.models.moe.token_ids import current_routing_token_ids, routing_token_ids


class _ForwardContext:
    """Re-enters the dropout position (and a shared block's depth), the routing token ids a forward ran under, and
    the store of the centroids its routing-attention cores routed with (re-enterable)."""

    def __init__(self, routed: contextlib.AbstractContextManager) -> None:
        self.contexts = (dropout_position(current_dropout_position()), dropout_depth(current_dropout_depth()),
                         routing_token_ids(current_routing_token_ids()), routed)

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc_info)


def _same_forward_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The recomputation draws the dropout masks, hash-routes the tokens, and routes attention with the k-means
    centroids (Roy et al. 2021) of the forward it repeats, wherever its backward runs (a pipeline schedule runs it
    after other microbatches' forwards, which move the centroids)."""
    routed = routed_centroids({})  # the forward fills it, the recomputation reads it
    return routed, _ForwardContext(routed)


def _wrap(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                              context_fn=_same_forward_context)


def apply_activation_checkpointing(stacks: list[nn.Module], mode: str) -> None:
    """Wrap the blocks (``full``) or their attention cores (``selective``) of each stack in place."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of none, full, selective")
    for stack in stacks:
        for key, block in list(stack.layers.items()):
            if mode == "full":
                stack.layers[key] = _wrap(block)
            else:
                attention = block.attention.sublayer
                attention.core = _wrap(attention.core)
