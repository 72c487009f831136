"""The benches' device: ``--device auto | cpu | cuda`` resolved, and the wait that makes a GPU step's clock true."""

from __future__ import annotations

import torch


def bench_device(name: str) -> torch.device:
    """``--device``'s device: ``auto`` is CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that the clock read next sees them done (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
