"""Every Triton kernel compiled on CUDA against its PyTorch reference: the kernel tests (tests/kernels: forward and
gradients, fp32 and bf16, odd shapes) rerun with CUDA as the default device and the interpreter off."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_checks import DRY_RUN, gpu

pytestmark = [*gpu, pytest.mark.skipif(DRY_RUN, reason="compiled kernels need CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_test_passes_compiled_on_cuda():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["XSCALE_KERNEL_TESTS_DEVICE"] = "cuda"
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # compiles in parallel where xdist is
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "tests/kernels"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(summary)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
