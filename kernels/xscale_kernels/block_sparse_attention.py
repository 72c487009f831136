"""Block-sparse attention, forward and backward, with FlashAttention's online softmax (Dao et al. 2022, alg. 1-2).

Input format (the contract with ``xscale.ops.block_sparse_attention``):
  q (B, H, Tq, hd), k and v (B, H, Tk, hd), contiguous, same dtype (fp32 / bf16 / fp16);
  block_size: the layout granularity, a power of two >= 16; query block i holds rows [i*bs, (i+1)*bs);
  block_index: int32 (Hl, n_q_blocks, max_nnz) with Hl = 1 (one layout for all heads) or H (per head):
      the key blocks query block i attends, the first block_count[h, i] entries valid, each key block once;
  block_count: int32 (Hl, n_q_blocks);
  causal: additionally hides key j > query i inside the listed blocks.
Softmax is over the listed keys only; a query row that sees no key returns 0 (and passes no gradient).
The backward's dK/dV pass walks the transposed layout (for each key block, the query blocks that read it),
so no atomics are needed. Returns o and the per-row log-sum-exp (float32, +inf for rows that see nothing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xscale_kernels._common import dot_in_fp32, dot_precision, next_power_of_2


@triton.jit
def _load_tile(PTR, rows, n_rows, head_dim, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (dims[None, :] < head_dim)
    tile = tl.load(PTR + rows[:, None] * head_dim + dims[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _attention_forward(Q, K, V, OUT, LSE, INDEX, COUNT, scale, seq_q, seq_k, head_dim, n_heads, layout_heads,
                       n_q_blocks, max_nnz,
                       CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    q_block = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    layout = (batch_head % n_heads) % layout_heads
    rows = q_block * BLOCK + tl.arange(0, BLOCK)
    q = _load_tile(Q + batch_head * seq_q * head_dim, rows, seq_q, head_dim, BLOCK_D, DOT_FP32)
    k_base = K + batch_head * seq_k * head_dim
    v_base = V + batch_head * seq_k * head_dim
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    count = tl.load(COUNT + layout * n_q_blocks + q_block)
    for i in range(0, count):
        k_block = tl.load(INDEX + (layout * n_q_blocks + q_block) * max_nnz + i)
        cols = k_block * BLOCK + tl.arange(0, BLOCK)
        k = _load_tile(k_base, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
        v = _load_tile(v_base, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = cols[None, :] < seq_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(row_max - safe_max)
        p = tl.exp(scores - safe_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    seen = row_sum > 0.0
    out = acc / tl.where(seen, row_sum, 1.0)[:, None]
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
    tl.store(OUT + batch_head * seq_q * head_dim + rows[:, None] * head_dim + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=mask)
    lse = tl.where(seen, row_max + tl.log(tl.where(seen, row_sum, 1.0)), float("inf"))
    tl.store(LSE + batch_head * seq_q + rows, lse, mask=rows < seq_q)


@triton.jit
def _attention_backward_dq(Q, K, V, DO, LSE, DELTA, DQ, INDEX, COUNT, scale, seq_q, seq_k, head_dim, n_heads,
                           layout_heads, n_q_blocks, max_nnz,
                           CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    q_block = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    layout = (batch_head % n_heads) % layout_heads
    rows = q_block * BLOCK + tl.arange(0, BLOCK)
    q = _load_tile(Q + batch_head * seq_q * head_dim, rows, seq_q, head_dim, BLOCK_D, DOT_FP32)
    do = _load_tile(DO + batch_head * seq_q * head_dim, rows, seq_q, head_dim, BLOCK_D, DOT_FP32)
    lse = tl.load(LSE + batch_head * seq_q + rows, mask=rows < seq_q, other=float("inf"))
    delta = tl.load(DELTA + batch_head * seq_q + rows, mask=rows < seq_q, other=0.0)
    k_base = K + batch_head * seq_k * head_dim
    v_base = V + batch_head * seq_k * head_dim
    dq = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    count = tl.load(COUNT + layout * n_q_blocks + q_block)
    for i in range(0, count):
        k_block = tl.load(INDEX + (layout * n_q_blocks + q_block) * max_nnz + i)
        cols = k_block * BLOCK + tl.arange(0, BLOCK)
        k = _load_tile(k_base, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
        v = _load_tile(v_base, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
        visible = cols[None, :] < seq_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        p = tl.where(visible, tl.exp(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
    tl.store(DQ + batch_head * seq_q * head_dim + rows[:, None] * head_dim + dims[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _attention_backward_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, T_INDEX, T_COUNT, scale, seq_q, seq_k, head_dim,
                             n_heads, layout_heads, n_k_blocks, max_nnz_t,
                             CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """Works in the transposed orientation: s^T = k q^T, so dV = p^T dO and dK = ds^T q need no transposes."""
    k_block = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    layout = (batch_head % n_heads) % layout_heads
    cols = k_block * BLOCK + tl.arange(0, BLOCK)
    k = _load_tile(K + batch_head * seq_k * head_dim, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
    v = _load_tile(V + batch_head * seq_k * head_dim, cols, seq_k, head_dim, BLOCK_D, DOT_FP32)
    q_base = Q + batch_head * seq_q * head_dim
    do_base = DO + batch_head * seq_q * head_dim
    dk = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    count = tl.load(T_COUNT + layout * n_k_blocks + k_block)
    for i in range(0, count):
        q_block = tl.load(T_INDEX + (layout * n_k_blocks + k_block) * max_nnz_t + i)
        rows = q_block * BLOCK + tl.arange(0, BLOCK)
        q = _load_tile(q_base, rows, seq_q, head_dim, BLOCK_D, DOT_FP32)
        do = _load_tile(do_base, rows, seq_q, head_dim, BLOCK_D, DOT_FP32)
        lse = tl.load(LSE + batch_head * seq_q + rows, mask=rows < seq_q, other=float("inf"))
        delta = tl.load(DELTA + batch_head * seq_q + rows, mask=rows < seq_q, other=0.0)
        visible = cols[:, None] < seq_k
        if CAUSAL:
            visible = visible & (cols[:, None] <= rows[None, :])
        p_t = tl.where(visible, tl.exp(tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale - lse[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    dims = tl.arange(0, BLOCK_D)
    mask = (cols[:, None] < seq_k) & (dims[None, :] < head_dim)
    offsets = batch_head * seq_k * head_dim + cols[:, None] * head_dim + dims[None, :]
    tl.store(DK + offsets, (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + offsets, dv.to(DV.dtype.element_ty), mask=mask)


def _meta(q: torch.Tensor, block_size: int) -> dict:
    block_d = max(16, next_power_of_2(q.shape[-1]))
    # fp32 tiles of 128 x 64 in three pipeline stages ask for 256 KiB of shared memory, over an H200's 227 KiB
    stages = 1 if q.element_size() >= 4 and block_size * block_d >= 128 * 64 else 3
    return {"DOT_FP32": dot_in_fp32(q.dtype), "PRECISION": dot_precision(), "BLOCK_D": block_d, "num_stages": stages}


class BlockSparseAttention(torch.autograd.Function):
    """The layout tables arrive validated (see ``xscale.ops.block_sparse_attention.BlockLayout``)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_index: torch.Tensor,
                block_count: torch.Tensor, transposed_index: torch.Tensor, transposed_count: torch.Tensor,
                block_size: int, causal: bool, scale: float | None) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
        layout_heads, n_q_blocks, max_nnz = block_index.shape
        _attention_forward[(n_q_blocks, batch * heads)](
            q, k, v, out, lse, block_index, block_count, scale, seq_q, seq_k, head_dim, heads, layout_heads,
            n_q_blocks, max_nnz, CAUSAL=causal, BLOCK=block_size, **_meta(q, block_size))
        ctx.save_for_backward(q, k, v, out, lse, block_index, block_count, transposed_index, transposed_count)
        ctx.block_size, ctx.causal, ctx.scale = block_size, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, block_index, block_count, transposed_index, transposed_count = ctx.saved_tensors
        dout = dout.contiguous()
        batch, heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        delta = (out.float() * dout.float()).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        layout_heads, n_q_blocks, max_nnz = block_index.shape
        n_k_blocks, max_nnz_t = transposed_index.shape[1:]
        common = {"CAUSAL": ctx.causal, "BLOCK": ctx.block_size, **_meta(q, ctx.block_size)}
        _attention_backward_dq[(n_q_blocks, batch * heads)](
            q, k, v, dout, lse, delta, dq, block_index, block_count, ctx.scale, seq_q, seq_k, head_dim, heads,
            layout_heads, n_q_blocks, max_nnz, **common)
        _attention_backward_dkdv[(n_k_blocks, batch * heads)](
            q, k, v, dout, lse, delta, dk, dv, transposed_index, transposed_count, ctx.scale, seq_q, seq_k,
            head_dim, heads, layout_heads, n_k_blocks, max_nnz_t, **common)
        return dq, dk, dv, None, None, None, None, None, None, None
