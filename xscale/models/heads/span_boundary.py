"""SpanBERT's span-boundary objective head (Joshi et al. 2020, sec. 3.2, eq. 1-2).

Each token x_i of a masked span (x_s, ..., x_e) is predicted from the encoder's states at the span's two boundary
tokens, x_{s-1} and x_{e+1}, and a relative position embedding p_{i-s+1} of the target inside the span:

    h0 = [x_{s-1}; x_{e+1}; p_{i-s+1}]
    h1 = LayerNorm(GeLU(W1 h0))
    y_i = LayerNorm(GeLU(W2 h1))

y_i goes through the MLM's output embedding to the vocabulary (the loss reads it as it reads the MLM's states), and
the training loss is L_MLM + L_SBO, both summed over the masked tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.heads.objective import Batch, TokenLossSum
from xscale.models.registry import OBJECTIVE_HEAD


@dataclasses.dataclass
class SpanBoundaryOptions:
    relative_positions: int = dataclasses.field(default=32, metadata={
        "help": "relative position embeddings p_1..p_K of a token inside its span; longer spans reuse p_K"})

    def __post_init__(self) -> None:
        if not 1 <= self.relative_positions <= 4096:
            raise ConfigError(f"model.objective_head.options.relative_positions must be in [1, 4096], got "
                              f"{self.relative_positions}")


@OBJECTIVE_HEAD.register("span_boundary")
class SpanBoundaryHead(nn.Module):
    """y_i = f(x_{s-1}, x_{e+1}, p_{i-s+1}) for each masked token i (module docstring); reads the batch's
    ``span_left``, ``span_right`` (boundary positions) and ``span_offset`` (i - s + 1, 0 where unmasked)."""

    Options = SpanBoundaryOptions
    corrupts_inputs, adds_to_token_loss = False, True
    batch_keys = ("span_left", "span_right", "span_offset")

    def __init__(self, config: ModelConfig, options: SpanBoundaryOptions) -> None:
        super().__init__()
        d = config.d_model
        self.relative_positions = options.relative_positions
        self.position = nn.Embedding(options.relative_positions, d)
        self.dense1 = nn.Linear(3 * d, d)
        self.norm1 = nn.LayerNorm(d)
        self.dense2 = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)

    def forward(self, hidden: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                offset: torch.Tensor) -> torch.Tensor:
        """(N, D) predictions y for N targets, from ``hidden`` (B, T, D) and (N, 2) row/position index pairs
        ``left`` and ``right`` of the boundary tokens and ``offset`` (N,) the 1-based place inside the span."""
        boundary_left = hidden[left[:, 0], left[:, 1]]
        boundary_right = hidden[right[:, 0], right[:, 1]]
        relative = self.position(offset.clamp(1, self.relative_positions) - 1)
        h1 = self.norm1(F.gelu(self.dense1(torch.cat([boundary_left, boundary_right, relative], dim=-1))))
        return self.norm2(F.gelu(self.dense2(h1)))

    def loss_sum(self, hidden: torch.Tensor, batch: Batch, token_loss_sum: TokenLossSum) -> torch.Tensor:
        """L_SBO summed over the masked tokens (those with ``span_offset`` > 0)."""
        rows, positions = torch.nonzero(batch["span_offset"] > 0, as_tuple=True)
        left = torch.stack([rows, batch["span_left"][rows, positions]], dim=1)
        right = torch.stack([rows, batch["span_right"][rows, positions]], dim=1)
        predictions = self(hidden, left, right, batch["span_offset"][rows, positions])
        return token_loss_sum(predictions, batch["labels"][rows, positions])
