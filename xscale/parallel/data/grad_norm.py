"""The global gradient norm of a model spread over a mesh, and clipping by it.

Each rank holds pieces of gradients: whole tensors replicated over data parallel, tensor-parallel shards (DTensor),
ZeRO shards, expert shards, pipeline stages. A piece held identically by ``r`` ranks of its pipeline stage
contributes ``|piece|^2 / r`` on each of them, so one all-reduce over the world sums every distinct element once:
``|g|^2 = sum over ranks of sum over pieces |piece|^2 / replicas(piece)``.
Clipping then scales by ``min(1, max_norm / (|g| + 1e-6))``, the formula of ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GradientPiece:
    """A local gradient tensor and how many ranks of its pipeline stage hold the same values; an uncounted
    piece (a copy whose twin is counted elsewhere) is clipped but adds nothing to the norm."""

    grad: torch.Tensor
    replicas: int
    counted: bool = True


def global_grad_norm(pieces: Sequence[GradientPiece], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm over every distinct gradient element of the model (float32 scalar on the gradients' device): each
    piece's norm in float32 (as ``clip_grad_norm_``), their squares summed in float64."""
    device = pieces[0].grad.device if pieces else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    counted = [piece for piece in pieces if piece.counted and piece.grad.numel()]
    if counted:
        norms = torch.stack(torch._foreach_norm([piece.grad.detach() for piece in counted], 2, dtype=torch.float32))
        replicas = torch.tensor([piece.replicas for piece in counted], dtype=torch.float64, device=device)
        total += (norms.double().square() / replicas).sum()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt().float()


@torch.no_grad()
def clip_gradients(pieces: Sequence[GradientPiece], max_norm: float,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients in place so their global norm is at most ``max_norm`` (0: only measure)."""
    norm = global_grad_norm(pieces, group)
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for piece in pieces:
            by_kind.setdefault((piece.grad.device, piece.grad.dtype), []).append(piece.grad)
        for (device, dtype), grads in by_kind.items():
            torch._foreach_mul_(grads, coefficient.to(device=device, dtype=dtype))
    return norm
