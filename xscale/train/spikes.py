"""Loss spikes: a step whose loss exceeds ``factor`` x the median of the last ``window`` losses.

The warning names the step and the global sample indices of its batch, so the data that caused it can be read back
(``dataset[i]``) or skipped. The median, unlike the mean, is not pulled up by the spike it is meant to reveal.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

MIN_HISTORY = 8  # losses seen before any step is judged (the first steps fall fast)


class LossSpikeDetector:
    """Counts (and, when ``announce``, prints one line for) each step whose loss exceeds ``factor`` x the running
    median; ``factor=0`` turns it off."""

    def __init__(self, factor: float, window: int, *, announce: bool = True,
                 min_history: int = MIN_HISTORY) -> None:
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)
        self.min_history = min(min_history, window)
        self.announce = announce
        self.count = 0

    def observe(self, step: int, loss: float, batch_indices: Callable[[], list[int]]) -> int:
        """Judge step ``step``'s loss against the losses before it, then remember it; returns the spikes so far.

        ``batch_indices`` gives the step's global sample indices; it is called only for a spike."""
        if self.factor <= 0 or not math.isfinite(loss):  # non-finite losses are train.on_nonfinite's business
            return self.count
        if len(self.recent) >= self.min_history:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                self.count += 1
                if self.announce:
                    print(f"xscale: loss spike at step {step}: loss {loss:.4f} > {self.factor:g} x median "
                          f"{median:.4f} of the last {len(self.recent)} steps; batch samples "
                          f"{batch_indices()}", flush=True)
        self.recent.append(loss)
        return self.count
