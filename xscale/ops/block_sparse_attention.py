"""Block-sparse attention's layout format and its dense reference (Child et al. 2019; Zaheer et al. 2020).

A layout lists, for each query block of ``block_size`` rows, the key blocks it attends:
  block_index int (n_q_blocks, max_nnz) or (H, n_q_blocks, max_nnz): key block ids, first block_count entries valid;
  block_count int (n_q_blocks,) or (H, n_q_blocks,).
A 2-D layout is shared by every head. ``causal`` additionally hides key j > query i within the listed blocks.
Query rows that see no key output 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """A validated layout: the (layout_heads, n_q, n_k) block mask and its row-wise and column-wise tables."""

    block_size: int
    mask: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor
    transposed_index: torch.Tensor
    transposed_count: torch.Tensor


def block_tables(mask: torch.Tensor, full_width: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of a (L, R, C) bool mask, its true columns ascending (padded to the widest row, or to all C
    columns with ``full_width``) and how many."""
    count = mask.sum(-1)
    columns = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    ordered = torch.where(mask, columns, mask.shape[-1]).sort(-1).values
    width = mask.shape[-1] if full_width else max(int(count.max()) if count.numel() else 0, 1)
    index = ordered[..., :width].clamp_max(max(mask.shape[-1] - 1, 0))
    return index.to(torch.int32).contiguous(), count.to(torch.int32).contiguous()


def build_layout(block_index: torch.Tensor, block_count: torch.Tensor, block_size: int, seq_q: int,
                 seq_k: int) -> BlockLayout:
    """Check a layout against the sequence lengths and derive the tables the kernels walk."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (tl.dot tiles), got {block_size}")
    n_q, n_k = -(-seq_q // block_size), -(-seq_k // block_size)
    index = block_index if block_index.dim() == 3 else block_index.unsqueeze(0)
    count = block_count if block_count.dim() == 2 else block_count.unsqueeze(0)
    if index.dim() != 3 or count.shape != index.shape[:2] or index.shape[1] != n_q:
        raise ValueError(f"block_index {tuple(block_index.shape)} / block_count {tuple(block_count.shape)} must be "
                         f"([H,] {n_q}, max_nnz) / ([H,] {n_q}) for {seq_q} queries in blocks of {block_size}")
    if count.numel() and (int(count.min()) < 0 or int(count.max()) > index.shape[-1]):
        raise ValueError(f"block_count must lie in [0, {index.shape[-1]}] (max_nnz)")
    valid = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
    ids = index[valid].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_k):
        raise ValueError(f"key block ids must lie in [0, {n_k}) for {seq_k} keys in blocks of {block_size}")
    heads, rows = torch.nonzero(valid, as_tuple=True)[:2]
    mask = torch.zeros(index.shape[0], n_q, n_k, dtype=torch.bool, device=index.device)
    mask[heads, rows, ids] = True
    if int(mask.sum()) != ids.numel():
        raise ValueError("a query block lists the same key block twice in block_index")
    row_index, row_count = block_tables(mask)
    col_index, col_count = block_tables(mask.transpose(1, 2))
    return BlockLayout(block_size, mask, row_index, row_count, col_index, col_count)


def element_mask(layout: BlockLayout, seq_q: int, seq_k: int, causal: bool) -> torch.Tensor:
    """(layout_heads, seq_q, seq_k) bool: which keys each query sees."""
    size = layout.block_size
    mask = layout.mask.repeat_interleave(size, 1).repeat_interleave(size, 2)[:, :seq_q, :seq_k]
    if causal:
        mask = mask & torch.ones(seq_q, seq_k, dtype=torch.bool, device=mask.device).tril()
    return mask


def block_sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                                     causal: bool, scale: float | None = None) -> torch.Tensor:
    """Dense softmax attention with the layout's element mask, in float32; rows that see nothing give 0."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    visible = element_mask(layout, q.shape[-2], k.shape[-2], causal).unsqueeze(0)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v.float()).to(q.dtype)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., T, d) zero-padded to ``rows`` rows (contiguous; no copy when it already has them)."""
    return x.contiguous() if x.shape[-2] == rows else F.pad(x, (0, 0, 0, rows - x.shape[-2]))


def block_sparse_attention_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                                    causal: bool, scale: float | None = None) -> torch.Tensor:
    """The PyTorch path: each query block attends to its listed key blocks, gathered side by side.

    Scores are (query block, its max_nnz listed key blocks), so time and memory grow with the layout's
    widest row times the number of query blocks, not with Tq * Tk; autograd differentiates through the
    gather (its backward is a scatter-add). q (B, H, Tq, hd), k/v (B, H, Tk, hd); rows that see no key give 0.
    """
    batch, heads, seq_q, head_dim = q.shape
    seq_k, size = k.shape[-2], layout.block_size
    n_q, n_k = layout.mask.shape[1:]
    scale = scale if scale is not None else head_dim**-0.5
    q_blocks = _pad_rows(q, n_q * size).view(batch, heads, n_q, size, head_dim)
    k_blocks = _pad_rows(k, n_k * size).view(batch, heads, n_k, size, head_dim)
    v_blocks = _pad_rows(v, n_k * size).view(batch, heads, n_k, size, head_dim)
    index = layout.index.long().expand(heads, -1, -1)  # (H, n_q, width): a shared layout serves every head
    width = index.shape[-1]
    head_of = torch.arange(heads, device=q.device).view(heads, 1, 1)
    keys = k_blocks[:, head_of, index].reshape(batch, heads, n_q, width * size, head_dim)
    values = v_blocks[:, head_of, index].reshape(batch, heads, n_q, width * size, head_dim)

    offsets = torch.arange(size, device=q.device)
    key_position = (index.unsqueeze(-1) * size + offsets).reshape(heads, n_q, 1, width * size)
    listed = (torch.arange(width, device=q.device) < layout.count.expand(heads, -1).unsqueeze(-1))
    visible = listed.repeat_interleave(size, dim=-1).unsqueeze(2) & (key_position < seq_k)
    if causal:
        query_position = (torch.arange(n_q, device=q.device).view(n_q, 1) * size + offsets).view(1, n_q, size, 1)
        visible = visible & (key_position <= query_position)
    has_key = visible.any(-1, keepdim=True)
    # rows that see nothing get finite scores (then zero weights), so no nan reaches the backward
    hidden = ~visible & has_key
    scores = (q_blocks.float() @ keys.float().transpose(-1, -2)) * scale
    weights = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
    if not bool(has_key.all()):
        weights = weights * has_key
    out = (weights @ values.float()).reshape(batch, heads, n_q * size, head_dim)[:, :, :seq_q]
    return out.to(q.dtype)
