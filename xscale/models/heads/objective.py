"""The pre-training objectives' extra heads (``model.objective_head``): what a head shows the loss, and the kind
that adds none. The heads: :mod:`~xscale.models.heads.span_boundary` (SpanBERT's SBO),
:mod:`~xscale.models.heads.sentence_pair` (BERT's NSP, ALBERT's SOP) and
:mod:`~xscale.models.heads.replaced_token_detection` (ELECTRA's generator and discriminator)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.registry import OBJECTIVE_HEAD, NoOptions

Batch = dict[str, torch.Tensor]
# The summed token cross-entropy of states (N, D) through the output embedding against labels (N,): the loss owns
# the projection (fused, or split by vocabulary), so a head that predicts tokens hands it its states.
TokenLossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ObjectiveHead(Protocol):
    """A head whose loss is added to the model's: it reads the final states and the batch's ``batch_keys``.
    ``corrupts_inputs``: the model reads the token ids the head's ``corrupt`` makes (ELECTRA's generator samples);
    ``adds_to_token_loss``: the model's own MLM loss counts too."""

    batch_keys: tuple[str, ...]
    corrupts_inputs: bool
    adds_to_token_loss: bool

    def loss_sum(self, hidden: torch.Tensor, batch: Batch, token_loss_sum: TokenLossSum) -> torch.Tensor: ...


@OBJECTIVE_HEAD.register("none")
class NoObjectiveHead:
    """No extra head: the objective's token loss alone."""

    Options = NoOptions


def build_objective_head(config: ModelConfig) -> nn.Module | None:
    """The head ``model.objective_head`` names, or None for ``none``."""
    if config.objective_head.kind == "none":
        return None
    return OBJECTIVE_HEAD.build(config.objective_head, "model.objective_head", config)
