"""Block-sparse softmax attention for any :mod:`patterns` layout, in memory and time proportional to its non-zero blocks.

Each (head, query block) row gathers the key/value blocks its layout row selects into a padded
(rows, width, block, hd) tensor; rows are grouped by their count of blocks (powers of two) so that padding
never more than doubles the work, and a dense row (a global token) does not pad every other row.
Inside the gathered blocks the exact token rule, causality and the sequence end are applied as a mask.
Autograd differentiates through the gathers (index_select backward is a scatter-add).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.patterns import Pattern


@dataclasses.dataclass
class RowGroup:
    """Rows (flat head * n_blocks + query block) that share one padded width of key blocks."""

    rows: Tensor  # (R,)
    key_blocks: Tensor  # (R, W) flat kv-head * n_blocks + key block
    mask: Tensor  # (R, block, W * block) token-level permission
    has_key: Tensor  # (R, block, 1) whether the query sees any key at all


@dataclasses.dataclass
class BlockPlan:
    groups: list[RowGroup]
    n_blocks: int
    nonzero_blocks: int


def build_plan(pattern: Pattern, length: int, block: int, causal: bool, n_heads: int, n_kv_heads: int,
               device: torch.device) -> BlockPlan:
    """Turn a pattern into gather indices and token masks for a sequence of ``length`` tokens."""
    n_blocks = math.ceil(length / block)
    layout = pattern.layout(n_blocks, n_blocks, block, causal)
    if causal:
        layout = layout & torch.ones(n_blocks, n_blocks, dtype=torch.bool).tril()
    layout = layout.expand(n_heads, n_blocks, n_blocks).reshape(n_heads * n_blocks, n_blocks)
    counts = layout.sum(1)
    # Selected key blocks first, in increasing block order.
    order = torch.argsort((~layout).long() * n_blocks + torch.arange(n_blocks), dim=1)
    width_class = torch.ceil(torch.log2(counts.clamp_min(1).double())).long()
    groups = []
    offsets = torch.arange(block)
    for cls in torch.unique(width_class[counts > 0]).tolist():
        rows = torch.nonzero((width_class == cls) & (counts > 0)).flatten()
        width = int(counts[rows].max())
        blocks = order[rows, :width]
        head = rows // n_blocks
        query = (rows % n_blocks)[:, None] * block + offsets  # (R, block)
        key = (blocks[:, :, None] * block + offsets).reshape(len(rows), width * block)  # (R, W*block)
        slot_used = (torch.arange(width)[None, :] < counts[rows][:, None]).repeat_interleave(block, dim=1)
        mask = slot_used[:, None, :] & (key < length)[:, None, :]
        allowed = pattern.allows(head[:, None, None], query[:, :, None], key[:, None, :], block, causal, n_blocks)
        mask = mask & allowed
        if causal:
            mask = mask & (key[:, None, :] <= query[:, :, None])
        kv_head = head // (n_heads // n_kv_heads)
        groups.append(RowGroup(rows.to(device), (kv_head[:, None] * n_blocks + blocks).to(device), mask.to(device),
                               mask.any(-1, keepdim=True).to(device)))
    return BlockPlan(groups, n_blocks, int(counts.sum()))


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, block: int, *,
                           dropout: float = 0.0, training: bool = False) -> Tensor:
    """q (B, H, T, hd), k/v (B, Hkv, T, hd) -> (B, H, T, hd); a query with no allowed key outputs zeros."""
    batch, n_heads, length, head_dim = q.shape
    n_kv_heads, padded = k.shape[1], plan.n_blocks * block
    pad = (0, 0, 0, padded - length)
    q_blocks = F.pad(q, pad).reshape(batch, n_heads * plan.n_blocks, block, head_dim)
    k_blocks = F.pad(k, pad).reshape(batch, n_kv_heads * plan.n_blocks, block, head_dim)
    v_blocks = F.pad(v, pad).reshape(batch, n_kv_heads * plan.n_blocks, block, head_dim)
    scale = head_dim**-0.5
    outputs, rows = [], []
    for group in plan.groups:
        n_rows, width = group.key_blocks.shape
        flat = group.key_blocks.flatten()
        keys = k_blocks.index_select(1, flat).reshape(batch, n_rows, width * block, head_dim)
        values = v_blocks.index_select(1, flat).reshape(batch, n_rows, width * block, head_dim)
        queries = q_blocks.index_select(1, group.rows)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(group.has_key, probs, 0.0)
        if dropout > 0.0 and training:
            probs = F.dropout(probs, dropout)
        outputs.append(torch.matmul(probs, values))
        rows.append(group.rows)
    out = q_blocks.new_zeros(q_blocks.shape)
    if outputs:
        out = out.index_copy(1, torch.cat(rows), torch.cat(outputs, dim=1))
    return out.reshape(batch, n_heads, padded, head_dim)[:, :, :length]
