"""Rotary position embedding, half-split form (Su et al. 2021, eq. 34): y = x * cos + rotate_half(x) * sin.

With x = [x1, x2] over the halves of the head dim: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.
The backward is the transposed rotation: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xscale_kernels._common import next_power_of_2

_BLOCK_ROWS = 16


@triton.jit
def _rope_rotate(X, COS, SIN, Y, n_rows, seq_len, half,
                 BACKWARD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rows of X are (..., position) flattened; row r sits at position r % seq_len of the (seq_len, 2*half) tables."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < half)
    x_offsets = rows[:, None] * (2 * half) + cols[None, :]
    t_offsets = (rows % seq_len)[:, None] * (2 * half) + cols[None, :]
    x1 = tl.load(X + x_offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_offsets + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t_offsets, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t_offsets + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t_offsets, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t_offsets + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + x_offsets, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + x_offsets + half, y2.to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x_c = x.contiguous()
    y = torch.empty_like(x_c)
    seq_len, head_dim = cos.shape
    n_rows = x_c.numel() // head_dim
    _rope_rotate[(triton.cdiv(n_rows, _BLOCK_ROWS),)](x_c, cos, sin, y, n_rows, seq_len, head_dim // 2,
                                                      BACKWARD=backward, BLOCK_ROWS=_BLOCK_ROWS,
                                                      BLOCK_HALF=next_power_of_2(head_dim // 2))
    return y


class Rope(torch.autograd.Function):
    """cos/sin are position tables (not trained): they get no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, backward=True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, head_dim); cos, sin (T, head_dim) (leading size-1 dims are dropped)."""
    seq_len, head_dim = x.shape[-2], x.shape[-1]
    if head_dim % 2 or tuple(cos.shape[-2:]) != (seq_len, head_dim) or cos.numel() != seq_len * head_dim \
            or sin.shape != cos.shape:
        raise ValueError(f"apply_rope needs an even head dim and cos/sin of shape ({seq_len}, {head_dim}); "
                         f"got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return Rope.apply(x, cos.reshape(seq_len, head_dim).contiguous(), sin.reshape(seq_len, head_dim).contiguous())
