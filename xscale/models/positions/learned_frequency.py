"""Sinusoids with learned frequencies: Vaswani et al.'s absolute encoding (2017, sec. 3.5),

  PE(pos, 2i) = sin(pos w_i),   PE(pos, 2i + 1) = cos(pos w_i),

with each frequency w_i trained instead of fixed at 10000^(-2i/d) (the trainable sinusoidal absolute embedding of
Wang et al. 2021, "On Position Embeddings in BERT", sec. 3). The frequencies are kept as w_i = 10000^(-2i/d) e^(a_i),
so the trained log-offsets a_i start at the model's small normal init: at the start the encoding is the fixed
sinusoid up to that noise (a departure from a start at exactly the fixed frequencies). The encoding is a function of
the position, so any length up to ``model.max_seq_len`` works; tensor parallelism replicates the d/2 offsets and
context parallelism evaluates each rank's global positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xscale.models.position import PositionEncoding
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext
from xscale.runtime.step_context import positions_of


@POSITION.register("learned_frequency")
class LearnedFrequencySinusoid(PositionEncoding):
    """sin / cos(pos 10000^(-2i/d) e^(a_i)) added to the input, a_i learned."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    adds_to_input = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_frequency_offset = nn.Parameter(torch.zeros(-(-self.d_model // 2)))

    def frequencies(self) -> torch.Tensor:
        """w_i = 10000^(-2i/d) e^(a_i), i < ceil(d / 2)."""
        index = torch.arange(0, self.d_model, 2, device=self.log_frequency_offset.device, dtype=torch.float32)
        return torch.exp(index * (-math.log(10000.0) / self.d_model) + self.log_frequency_offset.float())

    def embed(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        positions = positions_of(context, x.shape[1], x.device).to(torch.float32)
        if x.shape[1] and int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"sequence length {int(positions.max()) + 1} exceeds model.max_seq_len={self.max_seq_len}")
        angle = positions[:, None] * self.frequencies()  # (T, ceil(d / 2))
        table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)[:, : self.d_model]  # sin, cos interleaved
        return x + table.to(x.dtype)
