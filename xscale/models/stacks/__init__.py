"""The stack variants (``model.stack``), one file each, registered in :data:`~xscale.models.registry.STACK`."""

from __future__ import annotations

from typing import Any

import torch

import xscale.models.stacks.act  # noqa: F401  (each variant registers itself)
import xscale.models.stacks.early_exit  # noqa: F401
import xscale.models.stacks.feedback  # noqa: F401
import xscale.models.stacks.funnel  # noqa: F401
import xscale.models.stacks.gbst  # noqa: F401
import xscale.models.stacks.memformer  # noqa: F401
import xscale.models.stacks.perceiver  # noqa: F401
import xscale.models.stacks.plain  # noqa: F401
import xscale.models.stacks.reversible  # noqa: F401
import xscale.models.stacks.token_learner  # noqa: F401
from xscale.config.schema import ModelConfig
from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack


def stack_variant(model: ModelConfig) -> tuple[type[Stack], Any]:
    """The class ``model.stack`` names and its options (parsed, defaults filled in)."""
    return STACK.get(model.stack.kind), STACK.options(model.stack, "model.stack")


def extra_blocks(model: ModelConfig) -> int:
    """Blocks the stack builds beyond ``model.total_layers`` (a funnel's decoder blocks, Dai et al. 2020 sec. 2.3)."""
    variant, options = stack_variant(model)
    return 0 if model.share_layers else variant.extra_blocks(model, options)


def stack_loss_positions(model: ModelConfig) -> int:
    """How many last positions the stack's output holds (:meth:`Stack.loss_positions`; 0: every one)."""
    variant, options = stack_variant(model)
    return variant.loss_positions(model, options)


def label_loss_positions(model: ModelConfig, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with the labels the stack's output does not reach set to -100 (no loss), where it holds the last
    positions only (:meth:`Stack.loss_positions`, Perceiver AR's), so the labelled-token count is the loss's."""
    positions = stack_loss_positions(model)
    labels = batch.get("labels")
    if not positions or labels is None or labels.dim() < 2 or labels.shape[1] <= positions:
        return batch
    kept = labels.clone()
    kept[:, :-positions] = -100
    return {**batch, "labels": kept}


def stack_description(model: ModelConfig) -> str:
    """How the stack runs its blocks, in words of the config: ``share_layers + reversible``, ``act``, ``plain``."""
    parts = (["share_layers"] if model.share_layers else []) + ([model.stack.kind] if model.stack.kind != "plain"
                                                                 else [])
    return " + ".join(parts) or "plain"


__all__ = ["Stack", "extra_blocks", "label_loss_positions", "stack_description", "stack_variant"]
