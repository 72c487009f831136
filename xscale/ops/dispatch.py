"""Choice of kernel backend for the fused ops (``train.kernels``): auto | triton | apex | torch.

Every op takes the backend as an argument (``backend=``); a model's modules hold the one they pass
(``Transformer.use_kernels``). There is no process-wide setting.

- ``torch``: the PyTorch references (``xscale.ops.reference`` and the ``*_reference`` functions), unfused.
- ``triton``: the Triton kernels (``kernels/xscale_kernels``). CUDA tensors, or CPU tensors with
  ``TRITON_INTERPRET=1`` set before the kernel modules are imported (the interpreter); anything else is an error.
- ``apex``: NVIDIA apex's fused RMSNorm/LayerNorm (and FusedAdam); apex must be importable and the tensors on
  CUDA. Ops apex has no kernel for take the PyTorch path as under ``auto`` (chunked cross-entropy, gathered
  block-sparse attention).
- ``auto``: triton for CUDA tensors when triton imports; else apex for the norms when apex imports and the
  tensors are on CUDA; else PyTorch, where the linear cross-entropy takes the chunked PyTorch path and
  block-sparse attention the gathered one (key blocks side by side, no Tq x Tk scores), so CPU runs save
  their memory too. Distributed tensors (DTensor) always take the PyTorch reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import cache
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "apex", "torch")


def check_backend(name: str) -> str:
    """``name`` if it is a backend, else a ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend '{name}' is not one of {', '.join(BACKENDS)} (train.kernels)")
    return name


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def apex_importable() -> bool:
    """NVIDIA apex with its fused norms (the unrelated PyPI package called ``apex`` does not count)."""
    try:
        return importlib.util.find_spec("apex.normalization") is not None
    except (ImportError, ValueError):
        return False


def is_distributed(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def choose_backend(tensors: tuple[torch.Tensor, ...], backend: str = "auto", apex_has_op: bool = False) -> str:
    """'triton', 'apex' or 'torch' for an op on these tensors under the setting ``backend``."""
    check_backend(backend)
    if backend == "torch" or any(is_distributed(t) for t in tensors):
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError("train.kernels is 'triton' but triton is not installed: `pip install triton`, "
                               "or set train.kernels to auto or torch")
        if not on_cuda and not triton_interpreting():
            raise RuntimeError("train.kernels is 'triton' but the tensors are on CPU: Triton needs CUDA tensors, "
                               "or TRITON_INTERPRET=1 in the environment (set before xscale_kernels is imported) "
                               "to run the kernels in Triton's CPU interpreter; or use train.kernels auto/torch")
        return "triton"
    if backend == "apex":
        if not apex_importable():
            raise RuntimeError("train.kernels is 'apex' but NVIDIA apex is not importable (it ships in NGC "
                               "containers; PyPI's 'apex' is another project); use train.kernels auto or torch")
        if apex_has_op and not on_cuda:
            raise RuntimeError("train.kernels is 'apex' but the tensors are on CPU: apex kernels need CUDA")
        return "apex" if apex_has_op else "torch"
    if on_cuda and triton_importable():
        return "triton"
    if on_cuda and apex_has_op and apex_importable():
        return "apex"
    return "torch"


def kernel_module(name: str) -> ModuleType:
    """Import ``xscale_kernels.<name>``, checking its kernels can run where they are asked to."""
    module = importlib.import_module(f"xscale_kernels.{name}")
    if triton_interpreting():
        from triton.runtime.jit import JITFunction

        compiled = [attr for attr, value in vars(module).items() if isinstance(value, JITFunction)]
        if compiled:
            raise RuntimeError(f"xscale_kernels.{name} was imported before TRITON_INTERPRET=1 was set, so its "
                               f"kernels ({', '.join(compiled)}) were built for a GPU; triton reads the variable "
                               "when @triton.jit runs: set it before the first import of xscale_kernels.*")
    return module
