"""Which implementation each backend setting picks, and the errors for settings that cannot run."""

import os
import subprocess
import sys
import types

import pytest
import torch

from xscale import ops
from xscale.ops import dispatch


def _loss_node(backend: str) -> str:
    ops.set_kernel_backend(backend)
    hidden = torch.randn(5, 8, requires_grad=True)
    loss = ops.linear_cross_entropy_sum(hidden, torch.randn(11, 8), torch.randint(0, 11, (5,)))
    node = loss.grad_fn
    while node is not None and not node.name().startswith("ChunkedLinearCrossEntropy"):
        node = node.next_functions[0][0] if node.next_functions else None
    return "chunked" if node is not None else "unfused"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="not one of auto, triton, apex, torch"):
        ops.set_kernel_backend("cuda")


def test_cpu_auto_takes_pytorch_with_the_chunked_loss():
    ops.set_kernel_backend("auto")
    assert dispatch.choose_backend((torch.randn(2),), apex_has_op=True) == "torch"
    assert _loss_node("auto") == "chunked"
    assert _loss_node("torch") == "unfused"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    ops.set_kernel_backend("triton")
    assert dispatch.choose_backend((torch.randn(2),)) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5)


def test_triton_without_triton_installed(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: False)
    ops.set_kernel_backend("triton")
    with pytest.raises(RuntimeError, match="pip install triton"):
        ops.gated_activation(torch.randn(4), torch.randn(4), "silu")


def test_apex_backend_without_apex(monkeypatch):
    monkeypatch.setattr(dispatch, "apex_importable", lambda: False)
    ops.set_kernel_backend("apex")
    with pytest.raises(RuntimeError, match="apex is not importable"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="apex is not importable"):
        ops.apex.adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3)


def test_apex_is_used_only_when_importable_and_on_cuda(monkeypatch):
    """A stand-in apex module: apex is taken for the norms it has, PyTorch for the rest; CPU tensors are refused."""
    monkeypatch.setattr(dispatch, "apex_importable", lambda: True)
    ops.set_kernel_backend("apex")
    assert dispatch.choose_backend((torch.randn(2),), apex_has_op=False) == "torch"
    with pytest.raises(RuntimeError, match="need CUDA"):
        dispatch.choose_backend((torch.randn(2),), apex_has_op=True)
    calls = []
    fake = types.ModuleType("apex.normalization.fused_layer_norm")
    fake.fused_rms_norm_affine = lambda x, w, shape, eps: calls.append((tuple(shape), eps)) or x * w
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.normalization", types.ModuleType("apex.normalization"))
    monkeypatch.setitem(sys.modules, "apex.normalization.fused_layer_norm", fake)
    # stand in for CUDA tensors: the choice is checked above, here only that the apex function is called
    monkeypatch.setattr(ops.functional, "choose_backend", lambda tensors, apex_has_op=False: "apex")
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    assert calls == [((4,), 1e-6)]


def test_without_apex_adamw_is_torch():
    opt = ops.apex.adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW


def test_distributed_tensors_take_pytorch(monkeypatch):
    monkeypatch.setattr(dispatch, "is_distributed", lambda t: True)
    ops.set_kernel_backend("triton")
    assert dispatch.choose_backend((torch.randn(2),)) == "torch"


def test_kernels_imported_before_the_interpreter_flag_are_reported():
    code = ("import os, torch\n"
            "import xscale_kernels.gated\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from xscale import ops\n"
            "ops.set_kernel_backend('triton')\n"
            "try:\n"
            "    ops.gated_activation(torch.randn(4), torch.randn(4), 'silu')\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ".:kernels"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "imported before TRITON_INTERPRET=1 was set" in result.stdout, result.stdout + result.stderr
