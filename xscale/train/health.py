"""Training health: is the model still learning, so that its checkpoints are worth keeping?

A learning rate far too high can destroy a model in one step without a NaN: the loss jumps far above where it was,
or the gradient norm collapses to ~0 (saturated softmax, dead units) and the loss goes flat. Finite checkpoints of
such a model would rotate the good ones out (``checkpoint.keep``) long before a NaN stops the run. A step is
unhealthy when its loss exceeds ``loss_factor`` x the median of the last ``window`` healthy losses, or its gradient
norm falls below ``grad_collapse`` x their median gradient norm.

The loss of step N is that of the weights after step N-1, so checkpoint K is *confirmed* healthy by the first healthy
step after it; the last confirmed checkpoint is what the trainer keeps from rotation and names when the run stops.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path


class TrainingHealth:
    """Feed every finite step with :meth:`observe`, every checkpoint with :meth:`saved`; ``enabled=False``: every
    step is healthy (and every checkpoint confirmed by the next step)."""

    def __init__(self, enabled: bool, window: int, loss_factor: float, grad_collapse: float) -> None:
        self.enabled = enabled
        self.loss_factor, self.grad_collapse = loss_factor, grad_collapse
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.problem: str | None = None  # why the latest step was unhealthy (None: it was healthy)
        self.since: int | None = None  # the first step of the current unhealthy stretch
        self.announced = False  # the current stretch was reported
        self.pending: tuple[int, Path] | None = None  # a checkpoint saved and not yet confirmed by a healthy step
        self.last_healthy: tuple[int, Path] | None = None

    def observe(self, step: int, loss: float, grad_norm: float) -> str | None:
        """Judge step ``step`` (non-finite steps are train.on_nonfinite's: ignored here); returns what is wrong or
        None."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return self.problem
        self.problem = self._judge(loss, grad_norm) if self.enabled else None
        if self.problem is None:
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
            self.since, self.announced = None, False
            if self.pending is not None and self.pending[0] < step:
                self.last_healthy, self.pending = self.pending, None
        elif self.since is None:
            self.since = step
        return self.problem

    def _judge(self, loss: float, grad_norm: float) -> str | None:
        if not self.losses:
            return None
        loss_median, grad_median = statistics.median(self.losses), statistics.median(self.grad_norms)
        if loss > self.loss_factor * loss_median:
            return (f"loss {loss:.4g} is over {self.loss_factor:g} x the median {loss_median:.4g} of the last "
                    f"{len(self.losses)} healthy steps (train.health_loss_factor)")
        if grad_norm < self.grad_collapse * grad_median:
            return (f"gradient norm {grad_norm:.3g} collapsed below {self.grad_collapse:g} x the median {grad_median:.3g} "
                    f"of the last {len(self.grad_norms)} healthy steps (train.health_grad_collapse)")
        return None

    def saved(self, step: int, path: Path) -> None:
        """A checkpoint of step ``step`` was written at ``path``; the next healthy step confirms it."""
        self.pending = (step, path)

    def keep(self) -> Path | None:
        """The checkpoint retention must not delete: the last confirmed healthy one while training is unhealthy."""
        return self.last_healthy[1] if self.problem is not None and self.last_healthy else None
