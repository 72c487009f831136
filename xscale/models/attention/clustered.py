"""Clustered attention (Vyas et al. 2020, "Fast Transformers with Clustered Attention"): the queries of each head are
grouped into C clusters, attention is computed once per cluster centroid and copied to the cluster's queries,

  Q^c_j = sum_{i in S_j} Q_i / |S_j|,   A^c = softmax(Q^c K^T / sqrt(d)),   V^c = A^c V,   O_i = V^c_{c(i)}   (eq. 6-7),

O(T C d) instead of O(T^2 d). The improved variant (i-clustered, sec. 3.3, eq. 9-10; ``topk`` = k > 0): each centroid
also picks its k keys of highest attention, whose mass is m_j = sum_{l in topk(j)} A^c_jl; each query i of cluster j
recomputes its own attention on those keys and keeps the centroid's on the rest,

  O_i = m_j softmax_{l in topk(j)}(Q_i K_l^T / sqrt(d)) V_topk(j) + sum_{l not in topk(j)} A^c_jl V_l.

Departures: the clusters are found by Lloyd's k-means on the queries in Euclidean space (``iterations`` rounds,
centroids started at C evenly spaced positions so every layout clusters alike), where the paper first hashes the
queries to bits by random hyperplanes and clusters in Hamming space; the result the attention sees (a partition of
the queries and their mean) is the same kind. A centroid mixes queries from every position, so the core cannot be
causal (refused for decoders, as in the paper's encoder experiments), and it forms no per-query probabilities for
attention dropout. Heads are independent: tensor parallelism splits heads; context parallelism runs it on the
gathered sequence.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require_non_negative, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class ClusteredOptions:
    clusters: int = dataclasses.field(default=16, metadata={"help": "C: query clusters per head"})
    iterations: int = dataclasses.field(default=10, metadata={"help": "Lloyd k-means rounds"})
    topk: int = dataclasses.field(default=0, metadata={"help": "k > 0: improved clustered attention over each "
                                                                 "centroid's top-k keys (0: plain)"})

    def __post_init__(self) -> None:
        require_positive("clustered", clusters=self.clusters)
        require_non_negative("clustered", iterations=self.iterations, topk=self.topk)


@torch.no_grad()
def cluster_queries(q: Tensor, clusters: int, iterations: int) -> Tensor:
    """(B, H, T, d) queries -> (B, H, T) cluster index by Lloyd's k-means, centroids started at min(C, T) evenly
    spaced queries; an emptied cluster keeps its centroid."""
    length = q.shape[2]
    start = torch.linspace(0, length - 1, min(clusters, length), device=q.device).round().long()
    points = q.to(torch.promote_types(q.dtype, torch.float32))
    centroids = points[:, :, start]
    assignment = nearest(points, centroids)
    for _ in range(iterations):
        members = torch.nn.functional.one_hot(assignment, centroids.shape[2]).to(points.dtype)  # (B, H, T, C)
        counts = members.sum(2)[..., None]
        sums = members.transpose(-1, -2) @ points
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
        assignment = nearest(points, centroids)
    return assignment


def nearest(points: Tensor, centroids: Tensor) -> Tensor:
    """Index of the nearest centroid (squared Euclidean distance) of each point."""
    distances = (centroids * centroids).sum(-1)[..., None, :] - 2 * points @ centroids.transpose(-1, -2)
    return distances.argmin(-1)


def clustered_attention(q: Tensor, k: Tensor, v: Tensor, assignment: Tensor, clusters: int, topk: int) -> Tensor:
    """Eq. 6-7 (``topk`` = 0) or eq. 9-10 for q (B, H, T, d), k/v (B, H, Tk, d) and the query clusters (B, H, T)."""
    scale = q.shape[-1] ** -0.5
    members = torch.nn.functional.one_hot(assignment, clusters).to(q.dtype)  # (B, H, T, C)
    centroids = members.transpose(-1, -2) @ q / members.sum(2)[..., None].clamp_min(1)  # (B, H, C, d)
    centroid_probs = torch.softmax(centroids @ k.transpose(-1, -2) * scale, dim=-1)  # (B, H, C, Tk)
    centroid_out = centroid_probs @ v
    index = assignment[..., None]
    if topk == 0:
        return centroid_out.gather(2, index.expand(-1, -1, -1, v.shape[-1]))
    top_probs, top_keys = centroid_probs.topk(min(topk, k.shape[2]), dim=-1)  # (B, H, C, k)
    mass = top_probs.sum(-1, keepdim=True)
    rest = centroid_out - (top_probs[..., None] * gather_rows(v, top_keys)).sum(-2)  # centroid's on other keys
    keys_of_query = top_keys.gather(2, index.expand(-1, -1, -1, top_keys.shape[-1]))  # (B, H, T, k)
    own_keys, own_values = gather_rows(k, keys_of_query), gather_rows(v, keys_of_query)  # (B, H, T, k, d)
    own_probs = torch.softmax((own_keys @ q[..., None]).squeeze(-1) * scale, dim=-1)  # (B, H, T, k)
    exact = (own_probs[..., None] * own_values).sum(-2)
    return mass.gather(2, index) * exact + rest.gather(2, index.expand(-1, -1, -1, v.shape[-1]))


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, T, d), index (B, H, N, k) -> x's rows (B, H, N, k, d)."""
    flat = index.flatten(2)
    return x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1])).view(*index.shape, x.shape[-1])


@ATTENTION.register("clustered")
class ClusteredAttention(AttentionCore):
    """Attention per k-means cluster of the queries, with the improved top-k correction (Vyas et al. 2020)."""

    Options = ClusteredOptions
    causal_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # the probabilities are the centroids', not the queries'

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        clusters = min(self.options.clusters, q.shape[2])
        assignment = cluster_queries(q.detach(), clusters, self.options.iterations)
        return clustered_attention(q, k, v, assignment, clusters, self.options.topk)
