"""Grouped linear: E independent linears applied to rows grouped by expert, each GEMM writing in place.

y[rows of e] = x[rows of e] @ W[e]^T + b[e] for W [E, out, in], b [E, out]; the rows arrive sorted by
expert, ``counts[e]`` of them for expert e (variable sizes: dropless-capable). Written with autograd's
``split`` / ``unbind`` / ``cat``, every pass would copy the activations (and the stacked weight gradient)
once more; here each expert's GEMM reads and writes slices of preallocated buffers, in forward and in
backward (dX_e = dY_e W_e, dW_e = dY_e^T X_e, db_e = sum of dY_e's rows).
"""

from __future__ import annotations

import torch


def _rows(counts: list[int]):
    """(expert, row slice) of every expert with at least one row."""
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, slice(start, start + count)
        start += count


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                counts: list[int]) -> torch.Tensor:
        out = x.new_empty((x.shape[0], weight.shape[1]))
        for expert, rows in _rows(counts):
            if bias is None:
                torch.mm(x[rows], weight[expert].t(), out=out[rows])
            else:
                torch.addmm(bias[expert], x[rows], weight[expert].t(), out=out[rows])
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.has_bias = counts, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = x.new_empty(x.shape) if need_x else None
        grad_weight = weight.new_empty(weight.shape) if need_weight else None
        grad_bias = weight.new_empty(weight.shape[:2]) if need_bias and ctx.has_bias else None
        for expert, count in enumerate(ctx.counts):  # an expert without rows gets zero gradients
            if count == 0:
                for grad in (grad_weight, grad_bias):
                    if grad is not None:
                        grad[expert].zero_()
        for expert, rows in _rows(ctx.counts):
            if grad_x is not None:
                torch.mm(grad_out[rows], weight[expert], out=grad_x[rows])
            if grad_weight is not None:
                torch.mm(grad_out[rows].t(), x[rows], out=grad_weight[expert])
            if grad_bias is not None:
                torch.sum(grad_out[rows], dim=0, out=grad_bias[expert])
        return grad_x, grad_weight, grad_bias, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   counts: list[int]) -> torch.Tensor:
    """x [sum(counts), in] sorted by expert, weight [E, out, in], bias [E, out] or None -> [sum(counts), out].

    Under autocast the operands are cast to the autocast dtype first, as ``F.linear`` would be.
    """
    if len(counts) != weight.shape[0]:
        raise ValueError(f"got row counts for {len(counts)} experts, the weight stacks {weight.shape[0]}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"the row counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device, enabled=False):
        return _GroupedLinear.apply(x.contiguous(), weight, bias, counts)
