"""The training step a memory measurement runs (:mod:`~xscale.estimate.measure`), passed in by the train layer
above: its own module, so that the trainer names its step without importing the measurement (fake tensors, torch's
``MemTracker``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from xscale.config.schema import TrainConfig
from xscale.parallel.model import Batch, ParallelModel


@dataclass(frozen=True)
class StepRunner:
    """The training step a measurement runs (the train layer's is :data:`xscale.train.step.TRAINING_STEP`): the
    model's optimizer, and one forward and backward of a batch."""

    optimizer: Callable[[ParallelModel, TrainConfig], torch.optim.Optimizer]
    forward_backward: Callable[[ParallelModel, Batch], torch.Tensor]
