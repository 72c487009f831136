"""Comparison helper of the kernel tests (a module of its own: ``from conftest import`` clashes with
tests/ops/conftest.py when both folders are collected in one run)."""

import torch

# Tolerances, as a fraction of the reference's largest magnitude. fp32: both sides compute in fp32
# (sums in another order). bf16: the kernels keep fp32 inside and round once at the end, where the
# reference rounds after each PyTorch op; bf16 has an 8-bit mantissa (2^-8 = 0.4%).
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = max(expected.abs().max().item(), 1.0)
    error = (actual - expected).abs().max().item()
    assert error <= RELATIVE_TOLERANCE[dtype] * scale, f"{what}: max error {error:.3g} (scale {scale:.3g}, {dtype})"
