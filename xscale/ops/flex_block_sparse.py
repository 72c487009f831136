"""Block-sparse attention through PyTorch's FlexAttention (Dong et al. 2024, "Flex Attention").

A :class:`~xscale.ops.block_sparse_attention.BlockLayout` maps one to one onto FlexAttention's ``BlockMask``: its
key-block tables become ``kv_num_blocks`` / ``kv_indices``. Blocks that every query of the block sees whole (below
the diagonal under ``causal``, and inside the sequence) are passed as *full* blocks, which the kernel runs without
evaluating a mask; the others (the diagonal, a ragged last block) evaluate ``mask_mod``: key <= query under
``causal``, key < seq_k. ``mask_mod`` also reads the layout itself, because FlexAttention's unfused (CPU) path
evaluates it on every element and ignores the block tables. Rows that see no key give 0, as in the reference.

On CUDA ``flex_attention`` runs compiled (torch.compile generates a Triton kernel for the mask); on CPU torch runs
it eagerly, forward only, so training needs a GPU: the CPU paths are the ``triton`` interpreter, ``torch`` and
``auto`` (gathered) ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from xscale.ops.block_sparse_attention import BlockLayout, block_tables


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L, R) counts and (1, L, R, C) ascending column tables of a (L, R, C) bool mask, as BlockMask wants."""
    index, count = block_tables(mask, full_width=True)
    return count.unsqueeze(0), index.unsqueeze(0)


FLEX_BLOCK = 128  # the compiled kernel's query/key tile: a BlockMask's blocks must be multiples of it


def _blocks_of(fine: torch.Tensor, factor: int) -> torch.Tensor:
    """(L, R, C) bool over fine blocks -> (L, R/f, f, C/f, f), padded with False to whole coarse blocks."""
    heads, rows, columns = fine.shape
    padded = torch.zeros(heads, -(-rows // factor) * factor, -(-columns // factor) * factor, dtype=torch.bool,
                         device=fine.device)
    padded[:, :rows, :columns] = fine
    return padded.view(heads, padded.shape[1] // factor, factor, padded.shape[2] // factor, factor)


def block_mask_from_layout(layout: BlockLayout, seq_q: int, seq_k: int, causal: bool, device: torch.device):
    """The FlexAttention ``BlockMask`` of a layout (one head, or one per head): :func:`block_mask_of`."""
    return block_mask_of(layout.mask, layout.block_size, seq_q, seq_k, causal, device)


def block_mask_of(mask: torch.Tensor, size: int, seq_q: int, seq_k: int, causal: bool, device: torch.device,
                  token_rule: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
    """The FlexAttention ``BlockMask`` of a (Hp, n_q, n_k) bool block layout of ``size``-token blocks (Hp = 1 or
    one per head), under ``causal``, for seq_q queries and seq_k keys.

    A layout finer than the kernel's 128-row tile is described in 128-blocks: one is listed when any of its fine
    blocks is, full when all of them are full, and ``mask_mod`` (which reads the fine layout) does the rest.
    ``token_rule(head, query, key)``: an exact rule inside the listed blocks (a :mod:`patterns` rule); with one, no
    block is taken as full and ``mask_mod`` applies it everywhere.
    """
    from torch.nn.attention.flex_attention import BlockMask

    mask = mask.to(device)
    n_q, n_k = mask.shape[1:]
    row = torch.arange(n_q, device=device).view(n_q, 1)
    column = torch.arange(n_k, device=device).view(1, n_k)
    if token_rule is not None:  # the rule may cut inside any block: none is full
        whole = torch.zeros((n_q, n_k), dtype=torch.bool, device=device)
    else:
        whole = column < (seq_k // size)  # key blocks with no position past seq_k
        if causal:
            whole = whole & (column < row)  # every key of the block precedes every query of the row
    factor = max(1, FLEX_BLOCK // size)
    listed = _blocks_of(mask, factor).any(4).any(2)
    full = _blocks_of(mask & whole, factor).all(4).all(2)
    partial_count, partial_index = _ordered(listed & ~full)
    full_count, full_index = _ordered(full)
    per_head = mask.shape[0] > 1

    def visible(batch, head, query, key):
        listed = mask[head if per_head else 0, (query // size).clamp(max=n_q - 1), (key // size).clamp(max=n_k - 1)]
        inside = listed & (key < seq_k)
        if token_rule is not None:
            inside = inside & token_rule(head, query, key)
        return inside & (key <= query) if causal else inside

    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=size * factor,
                                    mask_mod=visible, seq_lengths=(seq_q, seq_k))


_BLOCK_MASKS: dict[tuple, tuple] = {}  # (id(layout), lengths, causal, device) -> (layout, BlockMask); a few kept


def _cached_block_mask(layout: BlockLayout, seq_q: int, seq_k: int, causal: bool, device: torch.device):
    """The layout's BlockMask, built once per layout and shape (a layout is reused across layers and steps)."""
    key = (id(layout), seq_q, seq_k, causal, str(device))
    if key not in _BLOCK_MASKS:
        if len(_BLOCK_MASKS) >= 8:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = (layout, block_mask_from_layout(layout, seq_q, seq_k, causal, device))
    return _BLOCK_MASKS[key][1]  # the layout is held too, so its id is not reused while the entry lives


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                                causal: bool, scale: float | None = None) -> torch.Tensor:
    """q (B, H, Tq, hd), k/v (B, H, Tk, hd) -> (B, H, Tq, hd) through FlexAttention with the layout's BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("block-sparse attention backend 'flex' trains on CUDA only (torch's FlexAttention "
                                  "has no CPU backward): use backend auto, triton or torch on CPU")
    block_mask = _cached_block_mask(layout, q.shape[-2], k.shape[-2], causal, q.device)
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    return attend(q, k, v, block_mask=block_mask, scale=scale)


def flex_attention_with(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask,
                        compiled: bool | None = None) -> torch.Tensor:
    """q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd) -> (B, H, Tq, hd) through FlexAttention with ``block_mask``
    (:func:`block_mask_of`); grouped kv heads are FlexAttention's ``enable_gqa``. ``compiled``: the compiled kernel
    (default: on CUDA; on CPU it runs forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled_flex_attention() if (q.is_cuda if compiled is None else compiled) else flex_attention
    return attend(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
