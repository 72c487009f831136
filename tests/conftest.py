"""Every test process runs the Triton kernels in triton's CPU interpreter, except the GPU tier's.

Set before any test module is imported: triton reads TRITON_INTERPRET when a kernel is decorated, and some
of its settings when it is first imported (megatron-core imports it from the data tests), so setting it later,
in the kernel tests' own conftest, is too late when another test module imported triton first.
The GPU tier (``python -m pytest -m gpu tests/gpu``: every path given lies under tests/gpu) checks the compiled
kernels, so there the interpreter stays off; ``XSCALE_KERNEL_TESTS_DEVICE=cuda`` carries that to xdist workers and
to the kernel tests it reruns on CUDA.
"""

import os
import sys
from pathlib import Path

GPU_TIER = Path(__file__).resolve().parent / "gpu"


def _gpu_tier_session() -> bool:
    if os.environ.get("XSCALE_KERNEL_TESTS_DEVICE") == "cuda":
        return True
    paths = [Path(arg).resolve() for arg in sys.argv[1:] if not arg.startswith("-") and os.path.exists(arg)]
    return bool(paths) and all(path == GPU_TIER or GPU_TIER in path.parents for path in paths)


if _gpu_tier_session():
    os.environ["XSCALE_KERNEL_TESTS_DEVICE"] = "cuda"
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

# The layers' config checks register when their packages are imported (xscale.config.check.register_check); every
# command imports them all (xscale.commands.registrations), and so does every test session.
import xscale.commands.registrations  # noqa: E402, F401
