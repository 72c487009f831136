"""Gated linear units: y = act(gate) * up, SwiGLU (silu), GeGLU (gelu, gelu_tanh), ReGLU (relu) (Shazeer 2020, eq. 5-6)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_BLOCK = 1024


@triton.jit
def _activation_and_slope(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g), in float32."""
    if ACTIVATION == 0:
        sig = tl.sigmoid(g)
        return g * sig, sig + g * sig * (1.0 - sig)
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACTIVATION == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        slope = 0.5 * (1.0 + tanh) + 0.5 * g * (1.0 - tanh * tanh) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * g * (1.0 + tanh), slope
    else:
        positive = g > 0.0
        return tl.where(positive, g, 0.0), tl.where(positive, 1.0, 0.0)


@triton.jit
def _gated_forward(GATE, UP, OUT, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_slope(g, ACTIVATION)
    tl.store(OUT + offsets, (act * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward(GATE, UP, DOUT, DGATE, DUP, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation_and_slope(g, ACTIVATION)
    tl.store(DGATE + offsets, (dout * u * slope).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offsets, (dout * act).to(DUP.dtype.element_ty), mask=mask)


class GatedActivation(torch.autograd.Function):
    """One elementwise pass forward, one backward; nothing but gate and up is saved."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        gate_c, up_c = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate_c)
        n = gate_c.numel()
        _gated_forward[(triton.cdiv(n, _BLOCK),)](gate_c, up_c, out, n,
                                                  ACTIVATION=ACTIVATION_CODES[activation], BLOCK=_BLOCK)
        ctx.save_for_backward(gate_c, up_c)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _gated_backward[(triton.cdiv(n, _BLOCK),)](gate, up, dout.contiguous(), dgate, dup, n,
                                                   ACTIVATION=ACTIVATION_CODES[ctx.activation], BLOCK=_BLOCK)
        return dgate, dup, None


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation '{activation}' has no fused kernel; use one of {', '.join(ACTIVATION_CODES)}")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return GatedActivation.apply(gate, up, activation)
