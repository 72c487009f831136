"""The early-exit stack (DeeBERT, Xin et al. 2020; PABEE, Zhou et al. 2020): the plain loop, keeping every layer's
output for the exits after it (:mod:`xscale.models.heads.early_exit`: the exits, the joint loss and the exit rules).
``model.stack: {kind: early_exit, options: {entropy, patience}}`` with ``train.task=classify``."""

from __future__ import annotations

import dataclasses

from xscale.config.schema import Config, ConfigError
from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack


@dataclasses.dataclass
class EarlyExitOptions:
    entropy: float = dataclasses.field(default=0.1, metadata={
        "help": "leave at the first layer whose prediction entropy (nats) is below this (DeeBERT)"})
    patience: int = dataclasses.field(default=0, metadata={
        "help": "> 0: leave once the prediction held for this many layers (PABEE) instead"})

    def __post_init__(self) -> None:
        if not self.entropy >= 0:
            raise ConfigError(f"model.stack.options.entropy must be >= 0 (0: no early exit), got {self.entropy}")
        if not self.patience >= 0:
            raise ConfigError(f"model.stack.options.patience must be >= 0 (0: the entropy rule), got "
                              f"{self.patience}")


@STACK.register("early_exit")
class EarlyExitStack(Stack):
    """Each block applied once, in order (:meth:`Stack.run`), every layer's output handed to the exits."""

    Options = EarlyExitOptions
    keeps_layer_states = True

    @classmethod
    def check(cls, config: Config, options: EarlyExitOptions) -> None:
        if config.train.task != "classify":
            raise ConfigError("model.stack=early_exit puts a classifier after every layer; it needs "
                              "train.task=classify")
