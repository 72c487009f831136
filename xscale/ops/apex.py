"""NVIDIA apex's fused kernels, used only when apex is importable (never a dependency)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from xscale.ops.dispatch import apex_importable, check_backend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine

    return fused_rms_norm_affine(x, weight, x.shape[-1:], eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    if bias is None:
        bias = torch.zeros_like(weight)
    return fused_layer_norm_affine(x, weight, bias, x.shape[-1:], eps)


def adamw(params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 0.0, backend: str = "auto") -> torch.optim.Optimizer:
    """apex FusedAdam (AdamW mode) on CUDA when train.kernels allows apex and it imports; else torch AdamW."""
    params = list(params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    check_backend(backend)
    if backend == "apex" and not apex_importable():
        raise RuntimeError("train.kernels is 'apex' but NVIDIA apex is not importable; use auto or torch")
    if backend in ("apex", "auto") and on_cuda and apex_importable():
        from apex.optimizers import FusedAdam

        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if on_cuda else None)
