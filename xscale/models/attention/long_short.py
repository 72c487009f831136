"""Long-Short Transformer (Zhu et al. 2021, "Long-Short Transformer: Efficient Transformers for Language and
Vision", sec. 3): each query attends jointly to a local window and to r keys of a dynamic low-rank projection,

  P = softmax_T(K W_P)  (T x r),   K_bar = P^T K,   V_bar = P^T V                      (eq. 3, long-range)
  K~ = [LN_L(K_window) ; LN_G(K_bar)],   V~ likewise                                   (eq. 4, DualLN)
  O_i = softmax(q_i K~^T / sqrt(d)) V~,

the window being the keys within distance ``window`` of the query (the paper's segment-wise sliding window, sec. 3.1).
Causal (sec. 3.3): the sequence is cut into segments of ``segment`` positions, each projected on its own
(P_s = softmax over its positions), and a query reads the r projected keys of every segment that ends at or before
it, with the window's left half. Departures: one W_P (d/H x r) shared by the heads (the paper learns one per head),
so tensor parallelism splits the heads with it replicated (gradients summed); the window is a band around each
query rather than the segment-aligned window of the paper's implementation (the same keys up to half a segment).
The scores are formed densely over the window (O(T^2) memory). Context parallelism runs it on the gathered sequence.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class LongShortOptions:
    window: int = dataclasses.field(default=8, metadata={"help": "w: keys within distance w of the query (short-term)"})
    rank: int = dataclasses.field(default=8, metadata={"help": "r: projected keys (long-term; per segment if causal)"})
    segment: int = dataclasses.field(default=16, metadata={"help": "l: positions per projected segment (causal)"})

    def __post_init__(self) -> None:
        require_positive("long_short", window=self.window, rank=self.rank, segment=self.segment)


@ATTENTION.register("long_short", "transformer_ls")
class LongShortAttention(AttentionCore):
    """Sliding window plus dynamic low-rank projection with DualLN (Zhu et al. 2021, eq. 3-4)."""

    Options = LongShortOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: LongShortOptions) -> None:
        super().__init__(model, layer_index, options)
        head_dim = model.d_model // model.n_heads
        self.projection = nn.Linear(head_dim, options.rank, bias=False)  # W_P
        self.local_norm = nn.LayerNorm(head_dim)  # LN_L
        self.global_norm = nn.LayerNorm(head_dim)  # LN_G

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        length = q.shape[2]
        projected_k, projected_v, visible = self.projected(k, v, causal)  # (B, H, n r, d), (T, n r)
        scale = q.shape[-1] ** -0.5
        local_k, local_v = self.local_norm(k), self.local_norm(v)
        distance = torch.arange(length, device=q.device)[None, :] - torch.arange(length, device=q.device)[:, None]
        near = distance.abs() <= self.options.window
        if causal:
            near = near & (distance <= 0)
        local_scores = (q @ local_k.transpose(-1, -2) * scale).masked_fill(~near, float("-inf"))
        global_scores = (q @ projected_k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        probs = self.dropout(torch.softmax(torch.cat([local_scores, global_scores], dim=-1), dim=-1), context)
        return probs[..., :length] @ local_v + probs[..., length:] @ projected_v

    def projected(self, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """LN_G(P^T K), LN_G(P^T V) and which queries see which projected key (Tq, n r): bidirectional one projection
        of the whole sequence (n = 1), causal one per segment, visible from the segment's last position on."""
        length, rank = k.shape[2], self.options.rank
        segment = self.options.segment if causal else length
        n_segments = -(-length // segment)
        pad = n_segments * segment - length
        logits = self.projection(k)  # (B, H, T, r)
        if pad:  # padded positions take no weight; a padded segment is never visible
            logits = F.pad(logits, (0, 0, 0, pad), value=float("-inf"))
            k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        batch, heads = k.shape[:2]
        weights = torch.softmax(logits.view(batch, heads, n_segments, segment, rank), dim=3)
        segments_k = k.view(batch, heads, n_segments, segment, -1)
        segments_v = v.view(batch, heads, n_segments, segment, -1)
        projected_k = (weights.transpose(-1, -2) @ segments_k).flatten(2, 3)  # (B, H, n r, d)
        projected_v = (weights.transpose(-1, -2) @ segments_v).flatten(2, 3)
        segment_end = (torch.arange(n_segments, device=k.device) + 1) * segment - 1
        if causal:
            visible = segment_end.repeat_interleave(rank)[None, :] <= torch.arange(length, device=k.device)[:, None]
        else:
            visible = torch.ones(length, n_segments * rank, dtype=torch.bool, device=k.device)
        return self.global_norm(projected_k), self.global_norm(projected_v), visible
