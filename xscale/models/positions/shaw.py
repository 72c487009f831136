"""Shaw et al. 2018, "Self-Attention with Relative Position Representations", eqs. 3-5:

    e_ij = q_i (k_j + a^K_ij)^T / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij),
    a^K_ij = w^K_clip(j - i, -k, k),  a^V_ij = w^V_clip(j - i, -k, k),

with tables w^K, w^V of 2k + 1 head-dim vectors shared across heads (sec. 3.2), and, as for T5's bias, one pair
of tables for a whole stack (the paper learns them per layer). The key term is a logit bias computed from q, the
value term is added to the attention output from the probabilities, so only a core that exposes its probabilities
(dense) can take it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.models.position import PositionEncoding
from xscale.models.positions.relative import ClippedDistanceOptions, pair_rows
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class ShawOptions(ClippedDistanceOptions):
    max_distance: int = dataclasses.field(default=16, metadata={"help": "k: relative distances are clipped to "
                                                                        "[-k, k] (2k + 1 table rows)"})


@POSITION.register("shaw")
class ShawRelativePosition(PositionEncoding):
    """Clipped relative embeddings a^K on the keys and a^V on the values (Shaw et al. 2018, eqs. 3-5)."""

    Options = ShawOptions
    parallel_traits = ParallelTraits(tp="replicated")
    biases_from_content = True
    mixes_values = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        max_distance = self.max_distance = self.options.max_distance
        self.key_table = nn.Parameter(torch.empty(2 * max_distance + 1, self.head_dim))
        self.value_table = nn.Parameter(torch.empty(2 * max_distance + 1, self.head_dim))

    def _buckets(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """clip(j - i, -k, k) + k: the table row of each (query, key) pair, (Tq, Tk)."""
        return pair_rows(q_len, k_len, device, self.max_distance, self.max_distance)

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, heads: slice,
                     context: StepContext | None = None) -> torch.Tensor:
        """q_i a^K_ij^T / sqrt(d): q against every table row, then each pair's row picked."""
        batch, n_heads, q_len, _ = q.shape
        by_row = q @ self.key_table.to(q.dtype).T * q.shape[-1] ** -0.5  # (B, h, Tq, 2k + 1)
        buckets = self._buckets(q_len, k.shape[2], q.device)
        return by_row.gather(-1, buckets.expand(batch, n_heads, q_len, -1))

    def value_term(self, probs: torch.Tensor, heads: slice, context: StepContext | None = None) -> torch.Tensor:
        """sum_j alpha_ij a^V_ij: the probabilities summed per table row, then times the rows."""
        batch, n_heads, q_len, k_len = probs.shape
        buckets = self._buckets(q_len, k_len, probs.device).expand(batch, n_heads, q_len, -1)
        per_row = probs.new_zeros(batch, n_heads, q_len, self.value_table.shape[0]).scatter_add_(-1, buckets, probs)
        return per_row @ self.value_table.to(probs.dtype)
