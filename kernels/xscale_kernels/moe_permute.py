"""MoE token permute / unpermute (the gather and weighted scatter around grouped experts; Shazeer et al. 2017).

permute:   out[p] = x[token_of[p]] for the N*k (token, slot) pairs sorted by expert id (stable).
unpermute: y[t]   = sum_j w[t, j] * expert_out[position[t, j]]  (position = where pair (t, j) went).
The sort itself (an argsort of N*k ids) stays in PyTorch; the kernels move the rows. No atomics: each
backward is again a gather, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xscale_kernels._common import next_power_of_2

_BLOCK_ROWS = 8


@triton.jit
def _gather_rows(X, SOURCE, SCALE, OUT, n_rows, width,
                 HAS_SCALE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[p] = X[SOURCE[p]] (* SCALE[p])."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    source = tl.load(SOURCE + rows, mask=row_mask, other=0).to(tl.int64)
    for start in range(0, width, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols[None, :] < width)
        values = tl.load(X + source[:, None] * width + cols[None, :], mask=mask, other=0.0)
        if HAS_SCALE:
            scale = tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)
            values = values.to(tl.float32) * scale[:, None]
        tl.store(OUT + rows[:, None] * width + cols[None, :], values.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _combine_rows(Y, POSITION, WEIGHT, OUT, n_tokens, width, top_k,
                  HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[t] = sum_j WEIGHT[t, j] * Y[POSITION[t, j]], accumulated in float32."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token_mask = tokens < n_tokens
    for start in range(0, width, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = token_mask[:, None] & (cols[None, :] < width)
        acc = tl.zeros((BLOCK_ROWS, BLOCK_D), tl.float32)
        for slot in range(0, top_k):
            position = tl.load(POSITION + tokens * top_k + slot, mask=token_mask, other=0).to(tl.int64)
            values = tl.load(Y + position[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                values *= tl.load(WEIGHT + tokens * top_k + slot, mask=token_mask, other=0.0).to(tl.float32)[:, None]
            acc += values
        tl.store(OUT + tokens[:, None] * width + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grads(Y, POSITION, DOUT, DWEIGHT, n_pairs, width, top_k,
                  BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """DWEIGHT[t, j] = <DOUT[t], Y[POSITION[t, j]]> over the flattened (t, j) pairs."""
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair_mask = pairs < n_pairs
    position = tl.load(POSITION + pairs, mask=pair_mask, other=0).to(tl.int64)
    token = pairs // top_k
    acc = tl.zeros((BLOCK_ROWS,), tl.float32)
    for start in range(0, width, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = pair_mask[:, None] & (cols[None, :] < width)
        y = tl.load(Y + position[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + token[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(y * dout, axis=1)
    tl.store(DWEIGHT + pairs, acc.to(DWEIGHT.dtype.element_ty), mask=pair_mask)


def _block_d(width: int) -> int:
    return min(next_power_of_2(width), 1024)


def _gather(x: torch.Tensor, source: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(source.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    _gather_rows[(triton.cdiv(source.numel(), _BLOCK_ROWS),)](
        x, source, scale if scale is not None else source, out, source.numel(), x.shape[1],
        HAS_SCALE=scale is not None, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=_block_d(x.shape[1]))
    return out


def _combine(y: torch.Tensor, position: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    n_tokens, top_k = position.shape
    out = torch.empty(n_tokens, y.shape[1], dtype=dtype, device=y.device)
    _combine_rows[(triton.cdiv(n_tokens, _BLOCK_ROWS),)](
        y, position, weight if weight is not None else position, out, n_tokens, y.shape[1], top_k,
        HAS_WEIGHT=weight is not None, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=_block_d(y.shape[1]))
    return out


class Permute(torch.autograd.Function):
    """x (N, d) -> (N*k, d) rows grouped by expert; backward sums each token's k row gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(position)
        return _gather(x.contiguous(), token_of)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (position,) = ctx.saved_tensors
        return _combine(dout.contiguous(), position, None, dout.dtype), None, None


class Unpermute(torch.autograd.Function):
    """(N*k, d) expert outputs -> (N, d): each token's k rows weighted by its gates and summed."""

    @staticmethod
    def forward(ctx, expert_out: torch.Tensor, position: torch.Tensor, token_of: torch.Tensor,
                pair_of: torch.Tensor, gate_weights: torch.Tensor) -> torch.Tensor:
        expert_out, gate_weights = expert_out.contiguous(), gate_weights.contiguous()
        ctx.save_for_backward(expert_out, position, token_of, pair_of, gate_weights)
        return _combine(expert_out, position, gate_weights, expert_out.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        expert_out, position, token_of, pair_of, gate_weights = ctx.saved_tensors
        dout = dout.contiguous()
        d_expert_out = _gather(dout, token_of, gate_weights.reshape(-1)[pair_of])
        d_weights = None
        if ctx.needs_input_grad[4]:
            d_weights = torch.empty_like(gate_weights)
            n_pairs = position.numel()
            _weight_grads[(triton.cdiv(n_pairs, _BLOCK_ROWS),)](
                expert_out, position, dout, d_weights, n_pairs, expert_out.shape[1], position.shape[1],
                BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=_block_d(expert_out.shape[1]))
        return d_expert_out, None, None, None, d_weights
