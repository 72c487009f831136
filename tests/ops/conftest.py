"""Op-level tests: the Triton backend runs in triton's CPU interpreter.

triton 3.9 reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel (when ``xscale_kernels.<module>``
is first imported), so it is set before anything imports a kernel module.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def two_threads():
    """Two intra-op threads for the test, the count before it restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
