"""Learning-rate schedules: linear warmup, then cosine / linear decay to min_lr_ratio * lr, or constant."""

from __future__ import annotations

import math

from xscale.config import TrainConfig


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step ``step`` (0-based)."""
    if train.warmup_steps and step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    floor = train.min_lr_ratio
    if train.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
