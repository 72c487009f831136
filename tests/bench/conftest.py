"""The kernel bench's smoke test also runs the Triton path, in triton's CPU interpreter.

triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel (when ``xscale_kernels.<module>`` is
first imported), so it is set before anything imports a kernel module.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
