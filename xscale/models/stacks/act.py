"""Adaptive Computation Time (Graves 2016) over a shared block: the Universal Transformer (Dehghani et al. 2019).

``model.stack=act``: one block is applied up to N = ``model.n_layers`` times (``model.share_layers``). After application n every
position t computes a halting probability from its state h_t^n

    p_t^n = sigmoid(w . h_t^n + b)

and halts at the first N(t) where sum_{n <= N(t)} p_t^n >= 1 - eps (``model.stack.options.threshold`` = 1 - eps), or at N.
Its remainder is R(t) = 1 - sum_{n < N(t)} p_t^n, and its output the weighted mean of its states

    y_t = sum_{n < N(t)} p_t^n h_t^n + R(t) h_t^{N(t)}.

The ponder cost rho_t = N(t) + R(t) (only R carries a gradient) is added to the loss as
``model.stack.options.ponder_cost`` * mean_t rho_t. As in the Universal Transformer, halted positions keep being transformed
(later positions may attend to them) but their output no longer changes. Every application runs on every step,
so each rank runs the same blocks whatever its data (collectives inside the block stay matched). Under context
parallelism each rank's ponder cost is the mean over its T/cp positions; shared out over one forward per cp rank
(``begin_training_step``), the shares sum to the whole sequence's mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.moe import attach_auxiliary_loss
from xscale.models.position import PositionEncoding
from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack, carrying_kinds
from xscale.models.traits import Refusal, StackTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class ActOptions:
    threshold: float = dataclasses.field(default=0.99, metadata={
        "help": "a position halts once its summed halting probability reaches 1 - eps = this"})
    ponder_cost: float = dataclasses.field(default=0.01, metadata={
        "help": "tau: the weight of the ponder cost N(t) + R(t) (mean over positions) in the loss"})

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ConfigError(f"model.stack.options.threshold must be in (0, 1) (1 - eps), got {self.threshold}")
        if not self.ponder_cost >= 0:
            raise ConfigError(f"model.stack.options.ponder_cost must be >= 0 (0: no ponder cost), got "
                              f"{self.ponder_cost}")


class AdaptiveComputationTime(nn.Module):
    """The halting unit and the ACT loop around a step function (module docstring)."""

    def __init__(self, config: ModelConfig, options: ActOptions) -> None:
        super().__init__()
        self.halting = nn.Linear(config.d_model, 1)
        self.threshold = options.threshold
        self.ponder_cost = options.ponder_cost
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


@STACK.register("act")
class ActStack(Stack):
    """The shared block ``layers.0`` applied up to ``n_layers`` times with per-position halting (module
    docstring); the halting unit is ``act`` (``stack.act.halting`` in checkpoints)."""

    Options = ActOptions
    stack_traits = StackTraits(
        pp=Refusal("the depth is dynamic per position: every step's state enters the halting-weighted output, so "
                   "the whole ACT loop must run on one stage"),
        sequence_parallel=Refusal("the ponder cost is a mean over each sequence's positions, which sequence "
                                  "parallelism splits"),
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: ActOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=cross, first_index=first_index, options=options)
        self.act = AdaptiveComputationTime(config, options)

    @classmethod
    def check(cls, config: Config, options: ActOptions) -> None:
        """Refuse model options ACT cannot run with, each with what to change."""
        model = config.model
        if not model.share_layers:
            raise ConfigError("model.stack=act applies one shared block up to model.n_layers times (the Universal "
                              "Transformer); set model.share_layers=true")
        if model.family == "encoder_decoder":
            raise ConfigError("model.stack=act supports model.family=decoder or encoder")
        if carrying_kinds(model):
            raise ConfigError("model.stack=act cannot carry attention scores from step to step (RealFormer); choose "
                              "another model.attention.kind")

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = self.layers["0"]
        return self.act(x, lambda h, depth: block(h, position, memory, context=context.at_depth(depth)),
                        len(self.depths)), scores
