"""Activation checkpointing (Chen et al. 2016): trade recomputation for activation memory.

``full`` recomputes every Transformer block in the backward pass; ``selective`` recomputes only the attention
cores (the softmax-sized activations, Korthikanti et al. 2022), keeping the cheap-to-store linear outputs. Wrappers
add ``_checkpoint_wrapped_module`` to parameter names; checkpoints and the initialiser strip it.

The recomputation draws the dropout masks, hash-routes the tokens, and routes attention with the k-means centroids
(Roy et al. 2021) of the forward it repeats, wherever its backward runs (a pipeline schedule runs it after other
microbatches' forwards, which move the centroids): it runs with the same arguments, the forward's
:class:`~xscale.runtime.StepContext` included, whose memo holds what the forward left for it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def _wrap(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)


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
