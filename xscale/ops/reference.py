"""PyTorch reference implementations of the fused ops (the tests' ground truth)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, reduced in float32."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).type_as(x)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over labels != -100, in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight^T, labels): the LM head and the loss in one op (fusable)."""
    return cross_entropy_sum(hidden @ weight.t(), labels)


# Elementwise activations by config name (FFNs, gated FFNs, BERT's head transform).
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] over the halves of the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up: SwiGLU (silu), GeGLU (gelu), ReGLU (relu)."""
    return ACTIVATIONS[activation](gate) * up


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's add and norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias, reduced in float32."""
    y = F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float() if bias is not None else None, eps)
    return y.type_as(x)


def layer_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return layer_norm(summed, weight, bias, eps), summed
