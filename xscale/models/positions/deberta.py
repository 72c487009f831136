"""DeBERTa's disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with Disentangled Attention",
sec. 3.1, eq. 2-4): besides content-to-content, each head scores content-to-position and position-to-content
through relative-position embeddings P (2k rows) projected by their own key and query matrices,

  delta(i, j) = clip(i - j, -k, k - 1) + k                                                  (eq. 3)
  K^r = P W_{k,r},  Q^r = P W_{q,r}
  A_ij = Q^c_i K^c_j^T + Q^c_i K^r_{delta(i,j)}^T + K^c_j Q^r_{delta(j,i)}^T,  scaled by 1/sqrt(3d)  (eq. 4)

The last two terms read the queries and keys, so they are a content bias (``PositionEncoding.content_bias``) that any
core taking a logit bias adds. Departures: the content-to-content term keeps the core's 1/sqrt(d) while the two
position terms take the paper's 1/sqrt(3d); one P, W_{k,r}, W_{q,r} per stack (the paper shares P across layers and
projects it per layer); the enhanced mask decoder (sec. 3.2) is not part of this. Tensor parallelism replicates it
(each rank reads its heads, gradients summed); context parallelism is refused (the terms need the whole sequence's
keys before the cp all-gather), as for Shaw's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.models.attention.core import expand_kv
from xscale.models.position import PositionEncoding
from xscale.models.positions.relative import ClippedDistanceOptions, pair_rows
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class DebertaOptions(ClippedDistanceOptions):
    max_distance: int = dataclasses.field(default=16, metadata={"help": "k: relative distances clipped to [-k, k)"})


@POSITION.register("deberta")
class DisentangledPosition(PositionEncoding):
    """Content-to-position and position-to-content scores over relative embeddings (He et al. 2021, eq. 2-4)."""

    Options = DebertaOptions
    parallel_traits = ParallelTraits(tp="replicated")
    biases_from_content = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.relative_embeddings = nn.Parameter(torch.empty(2 * self.options.max_distance, self.d_model))  # P
        self.key_projection = nn.Linear(self.d_model, self.n_heads * self.head_dim, bias=False)  # W_{k,r}
        self.query_projection = nn.Linear(self.d_model, self.n_heads * self.head_dim, bias=False)  # W_{q,r}

    def delta(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """delta(i, j) = clip(i - j, -k, k - 1) + k (Tq, Tk), queries the last Tq of Tk positions."""
        k = self.options.max_distance
        return pair_rows(q_len, k_len, device, k, k - 1, query_minus_key=True)

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, heads: slice,
                     context: StepContext | None = None) -> torch.Tensor:
        """(Q^c K^r_delta(i,j)^T + K^c Q^r_delta(j,i)^T) / sqrt(3d), on the scale of the core's q k^T / sqrt(d)."""
        batch, n_heads, q_len, head_dim = q.shape
        k = expand_kv(k, n_heads)
        k_len = k.shape[2]
        rows = self.relative_embeddings.shape[0]
        key_r = self.key_projection(self.relative_embeddings).view(rows, self.n_heads, head_dim)[:, heads]
        query_r = self.query_projection(self.relative_embeddings).view(rows, self.n_heads, head_dim)[:, heads]
        delta = self.delta(q_len, k_len, q.device)  # (Tq, Tk)
        content_to_position = (q @ key_r.permute(1, 2, 0).to(q.dtype)).gather(-1, delta.expand(batch, n_heads, -1, -1))
        by_key = k @ query_r.permute(1, 2, 0).to(k.dtype)  # (B, h, Tk, 2k): key j against every row
        reach = self.options.max_distance
        reverse = pair_rows(q_len, k_len, q.device, reach, reach - 1)  # delta(j, i) (Tq, Tk)
        position_to_content = by_key.transpose(-1, -2).gather(-2, reverse.expand(batch, n_heads, -1, -1))
        return (content_to_position + position_to_content) * (3 * head_dim) ** -0.5
