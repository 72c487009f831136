"""Routing attention (Roy et al. 2021, sec. 4): queries and keys are assigned to the nearest of k centroids
(spherical k-means on unit-norm vectors) and a query attends only to keys of its own cluster,
X'_i = sum_{j: c(K_j) = c(Q_i)} A_ij V_j (j <= i when causal).

Centroids are a per-head buffer, updated in training by an exponential moving average of the unit queries and
keys assigned to them, mu <- normalise(decay * mu + (1 - decay) * mean of the assigned) (the paper's eq. 11 with
means in place of sums, so the step does not grow with the batch); the update uses the assignments of the
forward that just ran, so a forward never sees centroids moved by its own tokens.

Balancing (ours; the paper takes the top-w tokens of every cluster, which lets later tokens push earlier ones
out and so reads the future): a query sees at most ``window`` keys of its cluster, the nearest by position
(causal: the ``window`` latest at or before it). It always sees its own key, so no row is empty. Cost T * w.
With one cluster and a window of T this is dense attention exactly.

``reduce_statistics`` (identity) sums the EMA statistics over data-parallel ranks; a data-parallel plan sets
it to an all-reduce so that every rank holds the same centroids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.config import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.sparse import layer_seed, require, require_positive
from xscale.models.registry import ATTENTION


@dataclasses.dataclass
class RoutingOptions:
    clusters: int = 4
    window: int = 16  # w: most keys of its cluster a query sees (besides its own)
    decay: float = 0.999  # EMA decay of the centroids
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive("routing", clusters=self.clusters, window=self.window)
        require(0.0 <= self.decay < 1.0, f"model.attention.options.decay must be in [0, 1) for 'routing' "
                                         f"(got {self.decay})")


def cluster_windows(query_cluster: Tensor, key_cluster: Tensor, window: int, causal: bool
                    ) -> tuple[Tensor, Tensor]:
    """For every query, the positions (B, H, Tq, w) of the keys it may see and whether each slot is used.

    Keys are sorted by (cluster, position); a query's keys are a run of that order inside its cluster.
    """
    length = key_cluster.shape[-1]
    position = torch.arange(length, device=key_cluster.device)
    key_code = key_cluster * length + position
    sorted_code, order = key_code.sort(dim=-1)
    query_code = query_cluster * length + torch.arange(query_cluster.shape[-1], device=query_cluster.device)
    cluster_start = torch.searchsorted(sorted_code, query_cluster * length)
    cluster_end = torch.searchsorted(sorted_code, (query_cluster + 1) * length)
    if causal:
        last = torch.searchsorted(sorted_code, query_code, right=True)  # after the latest key <= the query
        first = last - window
    else:
        centre = torch.searchsorted(sorted_code, query_code)
        first = torch.minimum(centre - window // 2, cluster_end - window).clamp_min(0)
        first = torch.maximum(first, cluster_start)
    slots = first[..., None] + torch.arange(window, device=key_cluster.device)
    used = (slots >= cluster_start[..., None]) & (slots < cluster_end[..., None])
    if causal:
        used = used & (slots < last[..., None])
    flat = slots.clamp(0, length - 1).flatten(2)
    positions = order.gather(-1, flat).view_as(slots)
    return positions, used


def gather_positions(x: Tensor, positions: Tensor) -> Tensor:
    """x (B, H, T, d), positions (B, H, Tq, w) -> (B, H, Tq, w, d)."""
    batch, heads, queries, width = positions.shape
    index = positions.reshape(batch, heads, queries * width, 1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, index).view(batch, heads, queries, width, x.shape[-1])


def local_statistics(statistics: Tensor) -> Tensor:
    """One process: the statistics are already global."""
    return statistics


@ATTENTION.register("routing")
class RoutingAttention(AttentionCore):
    Options = RoutingOptions
    per_head_state = ("centroids",)

    def __init__(self, model: ModelConfig, layer_index: int, options: RoutingOptions) -> None:
        super().__init__(model, layer_index, options)
        self.register_buffer("centroids", torch.empty(model.n_heads, options.clusters, model.head_dim))
        self.reduce_statistics: Callable[[Tensor], Tensor] = local_statistics
        if self.centroids.device.type != "meta":
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        generator = torch.Generator().manual_seed(layer_seed(self.options.seed, self.layer_index))
        draw = torch.randn(self.centroids.shape, generator=generator, dtype=torch.float64)
        self.centroids.copy_(F.normalize(draw, dim=-1).to(self.centroids.dtype))

    def assign(self, x: Tensor) -> Tensor:
        """(B, H, T, d) -> (B, H, T) index of the nearest centroid (cosine)."""
        return (F.normalize(x.detach(), dim=-1) @ self.centroids.to(x.dtype).transpose(-1, -2)[None]).argmax(-1)

    @torch.no_grad()
    def update_centroids(self, q: Tensor, k: Tensor, query_cluster: Tensor, key_cluster: Tensor) -> None:
        clusters = self.options.clusters
        units = torch.cat([F.normalize(q, dim=-1), F.normalize(k, dim=-1)], dim=2).float()  # (B, H, Tq + Tk, d)
        members = F.one_hot(torch.cat([query_cluster, key_cluster], dim=2), clusters).float()  # (B, H, T', k)
        sums = torch.einsum("bhtc,bhtd->hcd", members, units)
        counts = members.sum(dim=(0, 2))  # (H, k)
        statistics = self.reduce_statistics(torch.cat([sums, counts[..., None]], dim=-1))
        sums, counts = statistics[..., :-1], statistics[..., -1:]
        mean = sums / counts.clamp_min(1)
        decay = self.options.decay
        moved = F.normalize(decay * self.centroids.float() + (1 - decay) * mean, dim=-1)
        self.centroids.copy_(torch.where(counts > 0, moved, self.centroids.float()).to(self.centroids.dtype))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None) -> Tensor:
        require(q.shape[2] == k.shape[2], "routing attention is self-attention (equal query and key lengths)")
        check_heads(self, self.centroids, q.shape[1])
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        query_cluster, key_cluster = self.assign(q), self.assign(k)
        positions, used = cluster_windows(query_cluster, key_cluster, self.options.window, causal)
        scale = q.shape[-1] ** -0.5
        window_scores = torch.einsum("bhtd,bhtwd->bhtw", q, gather_positions(k, positions)) * scale
        own = torch.arange(q.shape[2], device=q.device)[:, None]
        self_in_window = (used & (positions == own)).any(-1, keepdim=True)
        self_score = (q * k).sum(-1, keepdim=True) * scale
        logits = torch.cat([window_scores.masked_fill(~used, float("-inf")),
                            self_score.masked_fill(self_in_window, float("-inf"))], dim=-1)
        probs = torch.softmax(logits, dim=-1)
        if self.training and self.model_config.attention_dropout > 0:
            probs = F.dropout(probs, self.model_config.attention_dropout)
        out = (torch.einsum("bhtw,bhtwd->bhtd", probs[..., :-1], gather_positions(v, positions))
               + probs[..., -1:] * v)
        if self.training:
            self.update_centroids(q.detach(), k.detach(), query_cluster, key_cluster)
        return out
