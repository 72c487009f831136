"""Kernel tests run the Triton kernels in triton's CPU interpreter.

triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when a module of
``xscale_kernels`` is first imported (not when triton is imported), so it is set here, before any
test module imports a kernel module.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
