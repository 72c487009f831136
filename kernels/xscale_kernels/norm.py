"""RMSNorm (Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016) with the residual add fused in.

s = x + residual;  y = (s - mean(s)) / sqrt(var(s) + eps) * w + b   (RMSNorm: no mean, no bias, var = mean(s^2)).
Returns (y, s): the normed output and the new residual stream. Statistics are kept in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xscale_kernels._common import next_power_of_2


@triton.jit
def _norm_forward(X, RES, W, B, Y, RES_OUT, MEAN, RSTD, n_cols, eps,
                  HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed = x + tl.load(RES + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rounded = summed.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * n_cols + cols, rounded, mask=mask)
        # normalise the stored (rounded) residual, as the unfused ``norm(x + residual)`` does
        x = rounded.to(tl.float32)
    if IS_RMS:
        centred = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        centred = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = centred * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_backward(DY, DRES_OUT, S, W, MEAN, RSTD, DS, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, rows_per_program,
                   HAS_RESIDUAL_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Each program takes ``rows_per_program`` rows and writes its partial dW/dB row (summed on the host)."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program * rows_per_program
    for offset in range(0, rows_per_program):
        row = (first + offset).to(tl.int64)
        if row < n_rows:
            s = tl.load(S + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            if IS_RMS:
                x_hat = s * rstd
            else:
                x_hat = tl.where(mask, (s - tl.load(MEAN + row)) * rstd, 0.0)
            dy_w = dy * w
            ds = dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / n_cols)
            if not IS_RMS:
                ds -= tl.sum(dy_w, axis=0) / n_cols
            ds = ds * rstd
            if HAS_RESIDUAL_GRAD:
                ds += tl.load(DRES_OUT + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DS + row * n_cols + cols, ds.to(DS.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            db += dy
    tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + program * n_cols + cols, db, mask=mask)


def _backward_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)  # the interpreter runs programs one after another: few, long programs are fastest


class FusedResidualNorm(torch.autograd.Function):
    """autograd.Function around the Triton kernels; inputs flattened to (rows, hidden)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float, is_rms: bool):
        shape = x.shape
        n_cols = shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()
        n_rows = x2.shape[0]
        has_residual = residual is not None
        res2 = residual.reshape(-1, n_cols).contiguous() if has_residual else x2
        y = torch.empty_like(x2)
        summed = torch.empty_like(x2) if has_residual else x2
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        weight_c = weight.contiguous()
        bias_c = bias.contiguous() if bias is not None else weight_c
        _norm_forward[(n_rows,)](x2, res2, weight_c, bias_c, y, summed, mean, rstd, n_cols, eps,
                                 HAS_RESIDUAL=has_residual, HAS_BIAS=bias is not None, IS_RMS=is_rms,
                                 BLOCK=next_power_of_2(n_cols))
        ctx.save_for_backward(summed, weight_c, mean, rstd)
        ctx.has_residual, ctx.has_bias, ctx.is_rms, ctx.shape = has_residual, bias is not None, is_rms, shape
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if has_residual:
            return y.view(shape), summed.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, *maybe_dres: torch.Tensor | None):
        summed, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = summed.shape
        dy2 = dy.reshape(n_rows, n_cols).contiguous()
        dres = maybe_dres[0] if maybe_dres else None
        dres2 = dres.reshape(n_rows, n_cols).contiguous() if dres is not None else dy2
        ds = torch.empty_like(summed)
        programs = _backward_programs(n_rows, summed.device)
        rows_per_program = triton.cdiv(n_rows, programs)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=summed.device)
        db_partial = torch.empty_like(dw_partial) if ctx.has_bias else dw_partial
        _norm_backward[(programs,)](dy2, dres2, summed, weight, mean, rstd, ds, dw_partial, db_partial,
                                    n_rows, n_cols, rows_per_program,
                                    HAS_RESIDUAL_GRAD=dres is not None, HAS_BIAS=ctx.has_bias, IS_RMS=ctx.is_rms,
                                    BLOCK=next_power_of_2(n_cols))
        dw = dw_partial.sum(0).to(ctx.weight_dtype)
        db = db_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        ds = ds.view(ctx.shape)
        return ds, (ds if ctx.has_residual else None), dw, db, None, None


def residual_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                  eps: float, is_rms: bool):
    """(norm(x + residual), x + residual), or norm(x) alone when ``residual`` is None."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return FusedResidualNorm.apply(x, residual, weight, bias, eps, is_rms)
