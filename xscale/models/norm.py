"""Normalisation layers (LayerNorm: Ba et al. 2016; RMSNorm: Zhang & Sennrich 2019)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.config.schema import Component, ConfigError
from xscale.models.registry import NORM
from xscale.ops import rms_norm


@dataclasses.dataclass
class NormOptions:
    """The options every norm takes."""

    eps: float = dataclasses.field(default=1e-5, metadata={"help": "added to the variance (or norm) before the "
                                                                   "division"})

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ConfigError(f"model.norm.options.eps must be positive, got {self.eps}")


@NORM.register("layernorm")
class LayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) * g + b."""

    Options = NormOptions

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)


@NORM.register("rmsnorm")
class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32."""

    Options = NormOptions
    kernels = "auto"  # the fused-op backend (Transformer.use_kernels)

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernels)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@NORM.register("scalenorm")
class ScaleNorm(nn.Module):
    """y = g * x / ||x|| with one learned scalar g initialised to sqrt(d) (Nguyen & Salazar 2019, eq. 3).

    g is held as a tensor of shape [1], not 0-d: FSDP2 (ZeRO-3) refuses 0-d parameters. A state dict with the
    0-d gain of earlier versions still loads through ``load_state_dict``; checkpoints are refused with a message
    (:func:`xscale.checkpoint.checkpointer.check_fingerprint`).
    """

    Options = NormOptions

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.scale = nn.Parameter(torch.full((1,), float(dim) ** 0.5))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        gain = state_dict.get(prefix + "scale")
        if isinstance(gain, torch.Tensor) and gain.dim() == 0:  # saved before the gain became [1]
            state_dict[prefix + "scale"] = gain.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return (self.scale * x.float() / norm).type_as(x)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(float(self.dim) ** 0.5)


def build_norm(norm: Component, dim: int) -> nn.Module:
    """The norm ``model.norm`` names over ``dim`` features, with its options (eps)."""
    return NORM.get(norm.kind)(dim, NORM.options(norm, "model.norm").eps)
