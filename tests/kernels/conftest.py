"""Kernel tests run the Triton kernels in triton's CPU interpreter.

triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when a module of
``xscale_kernels`` is first imported (not when triton is imported), so it is set here, before any
test module imports a kernel module.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
