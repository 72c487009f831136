"""Softmax cross-entropy rows for the chunked linear cross-entropy (one program per token row).

Forward: an online max / sum-exp sweep over vocab blocks (Milakov & Gimelshein 2018) gives
lse = log sum_v exp(z_v) and loss = lse - z_y. Backward: z_v <- (exp(z_v - lse) - [v == y]) * grad, in place.
The chunk loop and the matmuls (cuBLAS on GPU) live in ``xscale.ops.chunked_cross_entropy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xscale.ops.chunked_cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy_sum

_BLOCK_V = 1024


@triton.jit
def _cross_entropy_rows_forward(LOGITS, LABELS, LOSS, LSE, vocab, row_stride, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    row_start = LOGITS + row * row_stride
    running_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_start + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, z)
        # lanes that have seen only -inf keep a zero sum (avoid exp(-inf - -inf) = nan)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.exp(z - safe_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), axis=0))
    tl.store(LSE + row, lse)
    valid = label != ignore_index
    target = tl.load(row_start + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))


@triton.jit
def _cross_entropy_rows_backward(LOGITS, LABELS, LSE, GRAD, vocab, row_stride, ignore_index,
                                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    lse = tl.load(LSE + row)
    scale = tl.where(label != ignore_index, tl.load(GRAD).to(tl.float32), 0.0)
    row_start = LOGITS + row * row_stride
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        z = tl.load(row_start + cols, mask=mask, other=0.0).to(tl.float32)
        dz = (tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(row_start + cols, dz.to(LOGITS.dtype.element_ty), mask=mask)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """The logits with unit column stride (the chunk loop's padded-row view as it is; anything else copied)."""
    return logits if logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1] else logits.contiguous()


class TritonRowLoss:
    """The :class:`xscale.ops.chunked_cross_entropy.RowLoss` of the Triton kernels (rows ``stride(0)`` apart)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _rows(logits)
        rows, vocab = logits.shape
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        _cross_entropy_rows_forward[(rows,)](logits, labels.contiguous(), loss, lse, vocab, logits.stride(0),
                                             IGNORE_INDEX, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)))
        return loss, lse

    def backward(self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
        logits = _rows(logits)
        rows, vocab = logits.shape
        grad = grad.reshape(1).to(device=logits.device, dtype=torch.float32)
        _cross_entropy_rows_backward[(rows,)](logits, labels.contiguous(), lse.contiguous(), grad, vocab,
                                              logits.stride(0), IGNORE_INDEX,
                                              BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)))
        return logits

    def forward_backward(self, logits: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = _rows(logits)
        loss, lse = self.forward(logits, labels)  # reads the logits without writing them
        return loss, lse, self.backward(logits, labels, lse, torch.ones((), device=logits.device))


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int | None = None, gradient_in_forward: bool = True) -> torch.Tensor:
    """Sum of token CE of hidden @ weight^T over labels != -100, chunked, softmax rows in Triton."""
    return chunked_linear_cross_entropy_sum(hidden, weight, labels, TritonRowLoss(), chunk_tokens,
                                            gradient_in_forward)
