"""Learning-rate schedules: linear warmup, then cosine / linear decay to min_lr_ratio * lr, constant, or
warmup-stable-decay (WSD: the peak rate held, then a short final decay; Hu et al. 2024, MiniCPM, section 4;
Hägele et al. 2024 for the 1 - sqrt decay).

The decay is defined over ``train.schedule_steps`` (default ``train.steps``). A checkpoint keeps the schedule's
parameters (:func:`schedule_parameters`), and a resumed run whose schedule differs says so
(:func:`schedule_change`): raising ``train.steps`` would otherwise stretch a cosine curve already half travelled.
"""

from __future__ import annotations

import math
from typing import Any

from xscale.config.schema import TrainConfig

WSD_DEFAULT_DECAY_FRACTION = 0.2  # wsd without train.decay_steps: the last 20% of the schedule decays

DECAY_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def schedule_length(train: TrainConfig) -> int:
    """The steps the decay is defined over: train.schedule_steps, or train.steps when unset."""
    return train.schedule_steps or train.steps


def wsd_decay_steps(train: TrainConfig) -> int:
    """WSD's final decay length: train.decay_steps, or the last 20% of the schedule (at least one step)."""
    if train.decay_steps is not None:
        return train.decay_steps
    return max(1, round(WSD_DEFAULT_DECAY_FRACTION * schedule_length(train)))


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step ``step`` (0-based)."""
    if train.warmup_steps and step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    floor, length = train.min_lr_ratio, schedule_length(train)
    if train.schedule == "wsd":
        decay = wsd_decay_steps(train)
        decay_start = length - decay
        if step < decay_start:
            return 1.0
        shape, progress = DECAY_SHAPES[train.decay_shape], min(1.0, (step - decay_start) / decay)
    else:
        shape = DECAY_SHAPES[train.schedule]
        progress = min(1.0, (step - train.warmup_steps) / max(1, length - train.warmup_steps))
    return floor + (1.0 - floor) * shape(progress)


def schedule_parameters(train: TrainConfig) -> dict[str, Any]:
    """What fixes the curve of :func:`lr_factor`, resolved (kept in each checkpoint's meta.json)."""
    parameters: dict[str, Any] = {"schedule": train.schedule, "warmup_steps": train.warmup_steps}
    if train.schedule != "constant":
        parameters.update(schedule_steps=schedule_length(train), min_lr_ratio=train.min_lr_ratio)
    if train.schedule == "wsd":
        parameters.update(decay_steps=wsd_decay_steps(train), decay_shape=train.decay_shape)
    return parameters


def saved_schedule(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The schedule a checkpoint was written with: its ``schedule`` entry, or, for a checkpoint older than that
    entry, what its saved config implies (cosine/linear/constant over its train.steps)."""
    if "schedule" in meta:
        return meta["schedule"]
    train = meta.get("config", {}).get("train")
    if not train or train.get("schedule") not in ("cosine", "linear", "constant"):
        return None
    legacy = TrainConfig(steps=train["steps"], warmup_steps=train["warmup_steps"], schedule=train["schedule"],
                         min_lr_ratio=train["min_lr_ratio"])
    return schedule_parameters(legacy)


def schedule_change(saved: dict[str, Any] | None, train: TrainConfig, step: int) -> str | None:
    """One warning line when the schedule differs from the checkpoint's, naming what changed and the settings
    that keep the old curve; None when it is the same (or the checkpoint does not say)."""
    if saved is None:
        return None
    current = schedule_parameters(train)
    changed = [key for key in dict.fromkeys([*saved, *current]) if saved.get(key) != current.get(key)]
    if not changed:
        return None
    what = ", ".join(f"{key} {saved.get(key)} -> {current.get(key)}" for key in changed)
    keep = " ".join(f"train.{key}={saved[key]}" for key in changed if key in saved)
    return (f"xscale: warning: the learning-rate schedule differs from the checkpoint's ({what}); the rate "
            f"follows the new curve from step {step} on. To keep the old curve, set {keep}")
