"""What every GPU test shares: the marker that skips it without CUDA, tolerances, and the comparisons."""

import os

import pytest
import torch

# XSCALE_GPU_DRY_RUN=1 runs this tier's logic on CPU (CPU against CPU) to check the tests before GPU time is spent.
DRY_RUN = os.environ.get("XSCALE_GPU_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() or DRY_RUN),
                                   reason="needs a CUDA device (tests/gpu)")
gpu = [pytest.mark.gpu, requires_cuda]

# fp32 on CUDA vs CPU: TF32 stays off (torch's default for matmuls), sums in another order.
FP32_TOLERANCE = 2e-4
# bf16 autocast vs fp32: an 8-bit mantissa (2^-8 = 0.4%) rounded at every op of a few layers.
BF16_TOLERANCE = 5e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of the reference (at least 1)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu().flatten(), want.detach().float().cpu().flatten()
    if want.norm() == 0 and got.norm() == 0:
        return 1.0
    return torch.nn.functional.cosine_similarity(got, want, dim=0).item()
