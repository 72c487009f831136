"""Components whose behaviour is defined per optimizer step rather than per forward call.

One training step runs the model ``forwards`` times before the optimizer steps: its microbatches (gradient
accumulation, pipeline microbatches) on each of its data-parallel replicas, and activation checkpointing
repeats forwards inside backward. A per-forward count would therefore differ between layouts; a component that
needs the step (Performer/RFA feature redraws, the adaptive-span penalty counted once per step) defines
``begin_training_step(forwards)``, which the trainer's step calls once per step before its first forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def begin_training_step(parts: Iterable[nn.Module], forwards: int) -> None:
    """Call ``begin_training_step(forwards)`` once on every module of ``parts`` that defines it (a module shared
    between parts, or between depths of one part, is called once)."""
    seen: set[int] = set()
    for part in parts:
        for module in part.modules():
            # xscale.runtime.hooks.PerStepComponent's method, looked up on the class: isinstance with the protocol
            # costs ~10 us a module
            if callable(getattr(type(module), "begin_training_step", None)) and id(module) not in seen:
                seen.add(id(module))
                module.begin_training_step(forwards)
