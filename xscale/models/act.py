"""Adaptive Computation Time (Graves 2016) over a shared block: the Universal Transformer (Dehghani et al. 2019).

One block is applied up to N = ``model.n_layers`` times (``model.share_layers``). After application n every
position t computes a halting probability from its state h_t^n

    p_t^n = sigmoid(w . h_t^n + b)

and halts at the first N(t) where sum_{n <= N(t)} p_t^n >= 1 - eps (``model.act_threshold`` = 1 - eps), or at N.
Its remainder is R(t) = 1 - sum_{n < N(t)} p_t^n, and its output the weighted mean of its states

    y_t = sum_{n < N(t)} p_t^n h_t^n + R(t) h_t^{N(t)}.

The ponder cost rho_t = N(t) + R(t) (only R carries a gradient) is added to the loss as
``model.ponder_cost`` * mean_t rho_t. As in the Universal Transformer, halted positions keep being transformed
(later positions may attend to them) but their output no longer changes. Every application runs on every step,
so each rank runs the same blocks whatever its data (collectives inside the block stay matched). Under context
parallelism each rank's ponder cost is the mean over its T/cp positions; shared out over one forward per cp rank
(``begin_training_step``), the shares sum to the whole sequence's mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.moe import attach_auxiliary_loss
from xscale.models.registry import ATTENTION


def check_act_config(model: ModelConfig) -> None:
    """Refuse model options ACT cannot run with, each with what to change."""
    if not model.act:
        return
    if not model.share_layers:
        raise ConfigError("model.act=true applies one shared block up to model.n_layers times (the Universal "
                          "Transformer); set model.share_layers=true")
    if model.family == "encoder_decoder":
        raise ConfigError("model.act=true supports model.family=decoder or encoder")
    if any(kind in ATTENTION.names() and ATTENTION.get(kind).carries_scores
           for kind in model.attention.per_layer or [model.attention.kind]):
        raise ConfigError("model.act=true cannot carry attention scores from step to step (RealFormer); choose "
                          "another model.attention.kind")
    if model.reversible:
        raise ConfigError("model.act=true and model.reversible=true do not combine: ACT's output mixes every "
                          "step's state, which a reversible stack does not keep; set one of them to false")


class AdaptiveComputationTime(nn.Module):
    """The halting unit and the ACT loop around a step function (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.halting = nn.Linear(config.d_model, 1)
        self.threshold = config.act_threshold
        self.ponder_cost = config.ponder_cost
        self.aux_loss_scale = 1.0
        self.ponder_mean: torch.Tensor | None = None  # mean_t rho_t of the last forward, for the logs

    def begin_training_step(self, forwards: int) -> None:
        """The step's ponder cost is shared out over its ``forwards`` (microbatches x data-parallel replicas), so
        that its gradient is the global batch's mean cost, as one forward of the whole batch would give."""
        self.aux_loss_scale = 1.0 / forwards

    def layer_metrics(self) -> dict[str, float]:
        return {} if self.ponder_mean is None else {"ponder_mean": float(self.ponder_mean)}

    def forward(self, x: torch.Tensor, step: Callable[[torch.Tensor, int], torch.Tensor], steps: int) -> torch.Tensor:
        """y from x (B, T, D) after up to ``steps`` applications ``step(h, n)``, n = 0 .. steps-1."""
        total = x.new_zeros(x.shape[:-1])  # sum of p over the steps a position has run without halting
        running = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        output = torch.zeros_like(x)
        ponder = x.new_zeros(x.shape[:-1])
        h = x
        for n in range(steps):
            h = step(h, n)
            p = torch.sigmoid(self.halting(h)).squeeze(-1)
            halts = running & ((total + p >= self.threshold) | (n == steps - 1))
            remainder = 1 - total
            weight = torch.where(halts, remainder, torch.where(running, p, torch.zeros_like(p)))
            output = output + weight.unsqueeze(-1) * h
            ponder = ponder + running.to(ponder.dtype) + torch.where(halts, remainder, torch.zeros_like(p))
            total = total + torch.where(running & ~halts, p, torch.zeros_like(p))
            running = running & ~halts
        cost = ponder.mean()
        self.ponder_mean = cost.detach()
        if self.ponder_cost > 0 and torch.is_grad_enabled() and cost.requires_grad:
            output = attach_auxiliary_loss(output, self.aux_loss_scale * self.ponder_cost * cost.float())
        return output
