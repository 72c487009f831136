"""Kernel tests run the Triton kernels in triton's CPU interpreter, or compiled on CUDA.

triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when a module of
``xscale_kernels`` is first imported (not when triton is imported), so it is set here, before any
test module imports a kernel module. ``XSCALE_KERNEL_TESTS_DEVICE=cuda`` (tests/gpu runs this folder so)
leaves the interpreter off and makes CUDA the default device: the same tests then check the compiled kernels.
"""

import os

ON_CUDA = os.environ.get("XSCALE_KERNEL_TESTS_DEVICE") == "cuda"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _seed_and_device():
    torch.manual_seed(0)
    if ON_CUDA:
        assert torch.cuda.is_available(), "XSCALE_KERNEL_TESTS_DEVICE=cuda needs a CUDA device"
        with torch.device("cuda"):
            yield
    else:
        yield
