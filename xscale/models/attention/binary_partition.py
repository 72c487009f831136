"""BP-Transformer's binary-partition attention (Ye et al. 2019, "BP-Transformer: Modelling Long-Range Context via
Binary Partitioning", sec. 3): a binary tree over the sequence, node (l, n) the span [n 2^l, (n + 1) 2^l); each token
attends to its neighbours at the finest level and to ever coarser span nodes farther away (fine-to-coarse), about
w + 1 nodes per level, so O(w log(T / w)) keys per token:

  token i attends node (l, n)  iff  its parent is expanded for i and it is not (level-0 nodes are tokens, never
  expanded; the root always is);  node (l, n) is expanded for i iff  |n - a| <= w / 2 in parent units, that is
  floor((a - w) / 2) <= n <= floor((a + w) / 2), a = floor(i / 2^(l - 1)) the token's ancestor one level down.

The attended nodes partition the sequence (causal: the positions up to i, a node seen once it has ended), and
O_i = softmax(q_i K_N(i)^T / sqrt(d)) V_N(i) over them. Departures (the brief's simplification): a span node's key and
value are the means of its tokens' keys and values, built in each forward (BPT gives span nodes hidden states of
their own, updated by attending to their children, and relative position embeddings per level); ``window`` w sets
the neighbourhood at every level. The scores are formed densely over the T tokens and the ~T span nodes (O(T^2)
memory). Tensor parallelism splits the heads; context parallelism runs it on the gathered sequence.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class BinaryPartitionOptions:
    window: int = dataclasses.field(default=2, metadata={
        "help": "w: at each level, the nodes within w of the token's ancestor (rounded out to whole parents)"})

    def __post_init__(self) -> None:
        require_positive("bpt", window=self.window)


def span_levels(length: int) -> list[int]:
    """The levels l >= 1 whose span nodes are attended: below the root, the level whose one node spans the sequence."""
    return list(range(1, max(math.ceil(math.log2(length)), 1))) if length > 1 else []


def span_means(x: Tensor, level: int) -> Tensor:
    """(..., T, d) -> (..., ceil(T / 2^l), d): the mean over each span of 2^l positions (the last one may be short)."""
    size, length = 2**level, x.shape[-2]
    nodes = -(-length // size)
    sums = F.pad(x, (0, 0, 0, nodes * size - length)).unflatten(-2, (nodes, size)).sum(-2)
    counts = (length - torch.arange(nodes, device=x.device) * size).clamp(max=size)
    return sums / counts[:, None].to(x.dtype)


def attended_nodes(length: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """Bool (T, T + sum of the span levels' nodes): the tokens, then each level's nodes, attended by each token."""
    token = torch.arange(length, device=device)[:, None]
    columns = []
    for level in [0, *span_levels(length)]:
        nodes = torch.arange(-(-length // 2**level), device=device)[None, :]
        ancestor = token >> level
        in_parents = (nodes >= (ancestor - window).div(2, rounding_mode="floor") * 2) & (
            nodes <= (ancestor + window).div(2, rounding_mode="floor") * 2 + 1)  # the parent is expanded
        if level == 0:
            attended = in_parents
        else:
            below = token >> (level - 1)
            expanded = (nodes >= (below - window).div(2, rounding_mode="floor")) & (
                nodes <= (below + window).div(2, rounding_mode="floor"))
            attended = in_parents & ~expanded
        columns.append(attended & (nodes * 2**level <= token) if causal else attended)
    return torch.cat(columns, dim=1)


@ATTENTION.register("bpt", "binary_partition")
class BinaryPartitionAttention(AttentionCore):
    """Tokens attend to fine-to-coarse span nodes of a binary tree over the sequence (Ye et al. 2019, sec. 3)."""

    Options = BinaryPartitionOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        length = k.shape[2]
        if q.shape[2] != length:
            raise ValueError(f"bpt attention builds its tree over the {length} keys and needs as many queries (got "
                             f"{q.shape[2]}); it takes no KV cache or memory")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        levels = span_levels(length)
        keys = torch.cat([k, *(span_means(k, level) for level in levels)], dim=2)
        values = torch.cat([v, *(span_means(v, level) for level in levels)], dim=2)
        allowed = attended_nodes(length, self.options.window, causal, q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        return self.attend(q, keys, values, mask, context)
