"""Normalisation layers (LayerNorm: Ba et al. 2016; RMSNorm: Zhang & Sennrich 2019)."""

from __future__ import annotations

import torch
from torch import nn

from xscale.models.registry import NORM


@NORM.register("layernorm")
class LayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) * g + b."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)


@NORM.register("rmsnorm")
class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from xscale.ops import rms_norm

        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@NORM.register("scalenorm")
class ScaleNorm(nn.Module):
    """y = g * x / ||x|| with one learned scalar g initialised to sqrt(d) (Nguyen & Salazar 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.scale = nn.Parameter(torch.tensor(float(dim) ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return (self.scale * x.float() / norm).type_as(x)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(float(self.dim) ** 0.5)


def build_norm(name: str, dim: int, eps: float) -> nn.Module:
    return NORM.get(name)(dim, eps)
