"""Music Transformer's relative attention (Huang et al. 2018, "Music Transformer", sec. 3.4):

  RelativeAttention = softmax((Q K^T + S_rel) / sqrt(D_h)) V,   S_rel = skew(Q E_r^T),

E_r one learned D_h-vector per relative distance r = j - i and head. Q E_r^T scores each query against every
distance, and the skewing (sec. 3.4.1) moves entry (i, r) to column j = i + r by a pad, a reshape and a slice, so
S_rel[i, j] = q_i E_{j - i}^T without Shaw et al.'s (T, T, D_h) tensor of per-pair embeddings: O(T D) memory for the
embeddings instead of O(T^2 D). The paper skews the causal case (distances <= 0, a column padded on the left);
here one column is padded on the right of the distances -(Tk - 1), ..., Tq - 1, which serves both directions and
queries that are the last Tq of Tk positions (a KV cache).

Distances beyond ``max_distance`` share the farthest row (clipped as in Shaw's, :mod:`xscale.models.positions.relative`);
0 keeps a row for every distance up to ``model.max_seq_len - 1``, the paper's. Causal: rows for -k, ..., 0 only.
S_rel reads the queries, so it is a content bias (``PositionEncoding.content_bias``) that any core taking a logit
bias adds. One E_r per stack (the paper's is per layer). Tensor parallelism replicates it (each rank reads its heads'
rows, gradients summed); context parallelism is refused (the term needs the whole sequence's keys), as for Shaw's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.models.position import PositionEncoding
from xscale.models.positions.relative import ClippedDistanceOptions, distance_rows
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class MusicOptions(ClippedDistanceOptions):
    max_distance: int = dataclasses.field(default=0, metadata={
        "help": "k: relative distances clipped to [-k, k]; 0: every distance up to model.max_seq_len - 1"})
    least_distance = 0


def skew(by_distance: torch.Tensor, k_len: int) -> torch.Tensor:
    """(..., Tq, Tq + Tk - 1) scores of each query against the distances -(Tk - 1), ..., Tq - 1 -> (..., Tq, Tk) with
    [i, j] = by_distance[i, j - i + Tq - 1] (the queries the last Tq of Tk positions): a zero column padded on the
    right makes each row one longer, so read back with the shorter row length the rows shift by one per query."""
    q_len, width = by_distance.shape[-2:]
    padded = F.pad(by_distance, (0, 1)).flatten(-2)  # rows of width + 1
    return padded[..., : q_len * width].unflatten(-1, (q_len, width))[..., q_len - 1: q_len - 1 + k_len]


@POSITION.register("music")
class MusicRelativePosition(PositionEncoding):
    """S_rel = skew(Q E_r^T), per-head relative embeddings added to the logits (Huang et al. 2018, sec. 3.4)."""

    Options = MusicOptions
    parallel_traits = ParallelTraits(tp="replicated")
    biases_from_content = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reach = self.options.max_distance or self.max_seq_len - 1
        self.ahead = 0 if self.causal else self.reach  # causal: no row for the future
        self.embeddings = nn.Parameter(torch.empty(self.n_heads, self.reach + 1 + self.ahead, self.head_dim))  # E_r

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, heads: slice,
                     context: StepContext | None = None) -> torch.Tensor:
        """skew(Q E_r^T) / sqrt(D_h): q against each table row, the rows spread over the distances, then skewed."""
        q_len, k_len = q.shape[2], k.shape[2]
        by_row = q @ self.embeddings[heads].to(q.dtype).transpose(-1, -2)  # (B, h, Tq, table rows)
        distances = torch.arange(-(k_len - 1), q_len, device=q.device)
        by_distance = by_row[..., distance_rows(distances, self.reach, self.ahead)]  # (B, h, Tq, Tq + Tk - 1)
        return skew(by_distance, k_len) * q.shape[-1] ** -0.5
