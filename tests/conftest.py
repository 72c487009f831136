"""Every test process runs the Triton kernels in triton's CPU interpreter (there is no GPU here).

Set before any test module is imported: triton reads TRITON_INTERPRET when a kernel is decorated, and some
of its settings when it is first imported (megatron-core imports it from the data tests), so setting it later,
in the kernel tests' own conftest, is too late when another test module imported triton first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
