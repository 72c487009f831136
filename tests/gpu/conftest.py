"""The GPU tier (``python -m pytest -m gpu tests/gpu``): every test here needs CUDA and is skipped without it.

The Triton kernels must run compiled here, so the interpreter must be off: run this folder on its own, not in
one session with tests/kernels or tests/ops (whose conftests switch the interpreter on).
"""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _compiled_kernels_and_seed():
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
        # a whole-suite run on a GPU machine: the CPU tests need the interpreter, this tier needs it off
        pytest.skip("TRITON_INTERPRET=1 (the CPU tiers' setting): run the GPU tier on its own, "
                    "python -m pytest -m gpu tests/gpu")
    # fp32 comparisons against the CPU: no TF32 anywhere (matmuls default to full fp32; cuDNN convolutions do not)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
