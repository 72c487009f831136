"""Routing attention (Roy et al. 2021): queries and keys are assigned to the nearest of k centroids
(spherical k-means on unit-norm vectors) and a query attends only to keys of its own cluster,
X'_i = sum_{j: c(K_j) = c(Q_i)} A_ij V_j (j <= i when causal).

Centroids are a per-head buffer, updated in training by an exponential moving average of the unit queries and
keys assigned to them, mu <- normalise(decay * mu + (1 - decay) * mean of the assigned) (the paper's update with
means in place of sums, so the step does not grow with the batch). A training forward records its statistics
and applies them at the start of the next training forward, never inside backward: activation checkpointing
re-runs a forward during backward, and that rerun must route with the centroids the original forward used.
Where other forwards (which move the centroids) run between a forward and its backward, as in a pipeline
schedule, the recomputation finds them moved: a training forward keeps the centroids it routed with in its
context's memo (:class:`~xscale.runtime.StepContext`), and the recomputation, which activation checkpointing runs
with the same arguments, routes with those.

Balancing (ours): balancing clusters by letting each take its top-w tokens would let a later token push an
earlier one out of its cluster, which a decoder must not allow. Instead a query sees at most ``window`` keys of
its cluster, the nearest by position (causal: the ``window`` latest at or before it). It always sees its own key, so no row is empty. Cost T * w.
With one cluster and a window of T this is dense attention exactly.

The context's ``sum_over_replicas`` sums the EMA statistics over data-parallel ranks (an all-reduce over the dp
group that the data-parallel plan puts there), so every rank holds the same centroids (never over tp: there each
rank holds the centroids and statistics of its own heads).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.sparse import layer_seed, require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


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


def cluster_runs(query_cluster: Tensor, key_cluster: Tensor, window: int, causal: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Keys sorted by (cluster, position): (key_order (B, H, T) sorted slot -> position, and per query the
    slots [low, high) it may see, a run of at most ``window`` slots inside its own cluster)."""
    length = key_cluster.shape[-1]
    position = torch.arange(length, device=key_cluster.device)
    sorted_code, key_order = (key_cluster * length + position).sort(dim=-1)
    query_code = query_cluster * length + torch.arange(query_cluster.shape[-1], device=query_cluster.device)
    cluster_start = torch.searchsorted(sorted_code, query_cluster * length)
    cluster_end = torch.searchsorted(sorted_code, (query_cluster + 1) * length)
    if causal:
        end = torch.searchsorted(sorted_code, query_code, right=True)  # after the latest key <= the query
        return key_order, torch.maximum(end - window, cluster_start), end
    centre = torch.searchsorted(sorted_code, query_code)
    low = torch.maximum(torch.minimum(centre - window // 2, cluster_end - window), cluster_start)
    return key_order, low, torch.minimum(low + window, cluster_end)


def gather_positions(x: Tensor, positions: Tensor) -> Tensor:
    """x (B, H, T, d), positions (B, H, *shape) -> (B, H, *shape, d)."""
    batch, heads = positions.shape[:2]
    index = positions.reshape(batch, heads, -1, 1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, index).view(*positions.shape, x.shape[-1])


def blocked(x: Tensor, size: int, fill: int | float) -> Tensor:
    """(B, H, T, ...) -> (B, H, ceil(T / size), size, ...), the tail padded with ``fill``."""
    pad = -x.shape[2] % size
    if pad:
        filler = x.new_full((*x.shape[:2], pad, *x.shape[3:]), fill)
        x = torch.cat([x, filler], dim=2)
    return x.view(*x.shape[:2], -1, size, *x.shape[3:])


@ATTENTION.register("routing")
class RoutingAttention(AttentionCore):
    Options = RoutingOptions
    per_head_state = ("centroids", "pending_statistics")
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True, dp_statistics=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: RoutingOptions) -> None:
        super().__init__(model, layer_index, options)
        self.register_buffer("centroids", torch.empty(model.n_heads, options.clusters, model.head_dim))
        # Per cluster: sum of the unit vectors assigned in the last training forward, then their count.
        self.register_buffer("pending_statistics", torch.zeros(model.n_heads, options.clusters, model.head_dim + 1))
        if self.centroids.device.type != "meta":
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        generator = torch.Generator().manual_seed(layer_seed(self.options.seed, self.layer_index))
        draw = torch.randn(self.centroids.shape, generator=generator, dtype=torch.float64)
        self.centroids.copy_(F.normalize(draw, dim=-1).to(self.centroids.dtype))
        self.pending_statistics.zero_()

    def assign(self, x: Tensor, centroids: Tensor | None = None) -> Tensor:
        """(B, H, T, d) -> (B, H, T) index of the nearest centroid (cosine); ``centroids``: these instead of the
        current ones."""
        centroids = self.centroids if centroids is None else centroids
        return (F.normalize(x.detach(), dim=-1) @ centroids.to(x.dtype).transpose(-1, -2)[None]).argmax(-1)

    @torch.no_grad()
    def record_statistics(self, q: Tensor, k: Tensor, query_cluster: Tensor, key_cluster: Tensor,
                          context: StepContext | None = None) -> None:
        units = torch.cat([F.normalize(q, dim=-1), F.normalize(k, dim=-1)], dim=2).float()  # (B, H, Tq + Tk, d)
        members = F.one_hot(torch.cat([query_cluster, key_cluster], dim=2), self.options.clusters).float()
        sums = torch.einsum("bhtc,bhtd->hcd", members, units)
        counts = members.sum(dim=(0, 2))  # (H, k)
        statistics = torch.cat([sums, counts[..., None]], dim=-1)
        if context is not None and context.sum_over_replicas is not None:
            statistics = context.sum_over_replicas(statistics)
        self.pending_statistics.copy_(statistics.to(self.pending_statistics.dtype))

    @torch.no_grad()
    def apply_statistics(self) -> None:
        """Move the centroids by the recorded statistics (a no-op when none are pending)."""
        sums, counts = self.pending_statistics[..., :-1].float(), self.pending_statistics[..., -1:].float()
        decay = self.options.decay
        moved = F.normalize(decay * self.centroids.float() + (1 - decay) * sums / counts.clamp_min(1), dim=-1)
        self.centroids.copy_(torch.where(counts > 0, moved, self.centroids.float()).to(self.centroids.dtype))
        self.pending_statistics.zero_()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        require(q.shape[2] == k.shape[2], "routing attention is self-attention (equal query and key lengths)")
        check_heads(self, self.centroids, q.shape[1])
        learning = self.training and torch._C._current_graph_task_id() == -1  # -1: not replayed inside backward
        # Training forwards keep the centroids they route with in the context's memo (by core and depth); forwards
        # replayed inside backward route with those (a core not in the memo uses its current centroids).
        memo, key = (None, None) if context is None else (context.memo, ("routing", id(self), context.depth))
        centroids = None
        if learning:
            self.apply_statistics()
            if memo is not None:
                memo[key] = self.centroids.clone()
        elif self.training and memo is not None:  # a recomputation: route as the forward it repeats did
            centroids = memo.get(key)
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        query_cluster, key_cluster = self.assign(q, centroids), self.assign(k, centroids)
        out = self.attend(q, k, v, query_cluster, key_cluster, causal, context)
        if learning:
            self.record_statistics(q.detach(), k.detach(), query_cluster, key_cluster, context)
        return out

    def probability_positions(self, block_queries: Tensor, key_positions: Tensor, length: int,
                              context: StepContext | None = None) -> Tensor:
        """(B, H, n, C, W + 1) flat position of each gathered probability in the whole (H_all, T, T) matrix:
        (global head, query, key), the last slot being the query's own key. Slots of the window W (the widest
        run of the samples and heads in flight) are not positions, so masks drawn at them would change with the
        layout; the context says which slice of the heads this rank holds (tensor parallelism)."""
        n_heads, block = block_queries.shape[1], block_queries.shape[-1]
        heads = torch.arange(n_heads, device=key_positions.device) + self.dropout.shard_index(context) * n_heads
        rows = (heads.view(-1, 1, 1) * length + block_queries)[..., None]  # (B, H, n, C, 1)
        keys = torch.cat([key_positions[..., None, :].expand(*key_positions.shape[:3], block, -1),
                          block_queries[..., None]], dim=-1)
        return rows * length + keys

    def attend(self, q: Tensor, k: Tensor, v: Tensor, query_cluster: Tensor, key_cluster: Tensor,
               causal: bool, context: StepContext | None = None) -> Tensor:
        """Queries sorted by (cluster, position) in blocks of ``window``: a block's runs of key slots overlap, so
        it gathers their union once (width W, about 2 windows unless clusters hold far more keys than queries)
        and masks each query to its own run."""
        key_order, low, high = cluster_runs(query_cluster, key_cluster, self.options.window, causal)
        length, size = q.shape[2], self.options.window
        query_order = (query_cluster * length + torch.arange(length, device=q.device)).argsort(dim=-1)
        low, high = blocked(low.gather(-1, query_order), size, length), blocked(high.gather(-1, query_order), size, 0)
        block_low = low.amin(-1)  # (B, H, n)
        width = int((high.amax(-1) - block_low).max().clamp_min(1))
        slots = block_low[..., None] + torch.arange(width, device=q.device)  # (B, H, n, W)
        key_positions = key_order.gather(-1, slots.clamp(max=length - 1).flatten(2)).view_as(slots)
        allowed = (slots[..., None, :] >= low[..., None]) & (slots[..., None, :] < high[..., None])  # (B, H, n, C, W)
        own_slot = blocked(key_order.argsort(dim=-1).gather(-1, query_order), size, -1)
        self_in_run = ((own_slot >= low) & (own_slot < high))[..., None]
        queries = blocked(gather_positions(q, query_order), size, 0.0)  # (B, H, n, C, d)
        own_keys = blocked(gather_positions(k, query_order), size, 0.0)
        own_values = blocked(gather_positions(v, query_order), size, 0.0)
        scale = q.shape[-1] ** -0.5
        run_scores = (queries @ gather_positions(k, key_positions).transpose(-1, -2)) * scale
        self_score = (queries * own_keys).sum(-1, keepdim=True) * scale
        logits = torch.cat([run_scores.masked_fill(~allowed, float("-inf")),
                            self_score.masked_fill(self_in_run, float("-inf"))], dim=-1)
        probs = torch.softmax(logits, dim=-1)
        if self.training and self.dropout.p > 0:
            positions = self.probability_positions(blocked(query_order, size, 0), key_positions, length, context)
            probs = self.dropout.at_each(probs, positions, context)
        out = probs[..., :-1] @ gather_positions(v, key_positions) + probs[..., -1:] * own_values
        out = out.flatten(2, 3)[:, :, :length]  # sorted query order
        return torch.empty_like(out).scatter_(2, query_order[..., None].expand_as(out), out)

