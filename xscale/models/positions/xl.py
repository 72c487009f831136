"""Transformer-XL's relative attention (Dai et al. 2019, sec. 3.3, the four terms of A^rel_ij):

    A_ij = q_i k_j^T + q_i W_R R_{i-j}^T + u k_j^T + v W_R R_{i-j}^T    (all / sqrt(d), as in the paper's code)

R the sinusoid of the distance i - j (Vaswani et al. 2017, sec. 3.5), W_R the projection of positions to keys
(one per head, no bias), u and v learned vectors per head. The first term is the core's q k^T; the other three form
a logit bias computed here by a direct gather over the distances (the paper's relative shift computes the same).
One W_R, u and v serve a whole stack (the paper's code shares u and v across layers; W_R is per layer there).
Without a causal mask i - j is negative too; the sinusoid is defined there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xscale.models.position import PositionEncoding, relative_distances
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def relative_sinusoid(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """R_delta = [sin(delta / 10000^(2i/d)), cos(delta / 10000^(2i/d))] (Dai et al. 2019, as in their code)."""
    inverse_frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64, device=distances.device)
                                  * (-math.log(10000.0) / dim))
    angles = distances.to(torch.float64)[:, None] * inverse_frequency[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[:, :dim].float()


@POSITION.register("xl")
class TransformerXLPosition(PositionEncoding):
    """Sinusoidal relative positions projected by W_R, with the global biases u and v (Dai et al. 2019)."""

    parallel_traits = ParallelTraits(tp="replicated")
    biases_from_content = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.position_keys = nn.Parameter(torch.empty(self.n_heads * self.head_dim, self.d_model))  # W_R
        self.u = nn.Parameter(torch.empty(self.n_heads, self.head_dim))
        self.v = nn.Parameter(torch.empty(self.n_heads, self.head_dim))

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, heads: slice,
                     context: StepContext | None = None) -> torch.Tensor:
        """(q_i + v) W_R R_{i-j}^T + u k_j^T, over sqrt(d)."""
        batch, n_heads, q_len, head_dim = q.shape
        k_len = k.shape[2]
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)  # GQA/MQA: each kv head serves its query heads
        distance = -relative_distances(q_len, k_len, q.device)  # i - j, (Tq, Tk)
        nearest = int(distance.min())
        rows = relative_sinusoid(torch.arange(nearest, int(distance.max()) + 1, device=q.device), self.d_model)
        position_keys = (rows.to(q.dtype) @ self.position_keys.to(q.dtype).T).view(-1, self.n_heads, head_dim)[:, heads]
        u, v = self.u[heads].to(q.dtype), self.v[heads].to(q.dtype)
        by_distance = (q + v[None, :, None]) @ position_keys.permute(1, 2, 0)  # (B, h, Tq, distances)
        positional = by_distance.gather(-1, (distance - nearest).expand(batch, n_heads, q_len, -1))
        content = torch.einsum("hd,bhkd->bhk", u, k)[:, :, None, :]
        return (positional + content) * head_dim**-0.5
