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
    hidden = torch.randn(5, 8, requires_grad=True)
    loss = ops.linear_cross_entropy_sum(hidden, torch.randn(11, 8), torch.randint(0, 11, (5,)), backend=backend)
    node = loss.grad_fn
    while node is not None and not node.name().startswith("ChunkedLinearCrossEntropy"):
        node = node.next_functions[0][0] if node.next_functions else None
    return "chunked" if node is not None else "unfused"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="not one of auto, triton, apex, torch"):
        ops.check_backend("cuda")
    with pytest.raises(ValueError, match="not one of auto, triton, apex, torch"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5, backend="cuda")


def test_cpu_auto_takes_pytorch_with_the_chunked_loss():
    assert dispatch.choose_backend((torch.randn(2),), "auto", apex_has_op=True) == "torch"
    assert _loss_node("auto") == "chunked"
    assert _loss_node("torch") == "unfused"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    assert dispatch.choose_backend((torch.randn(2),), "triton") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5, backend="triton")


def test_triton_without_triton_installed(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        ops.gated_activation(torch.randn(4), torch.randn(4), "silu", backend="triton")


def test_apex_backend_without_apex(monkeypatch):
    monkeypatch.setattr(dispatch, "apex_importable", lambda: False)
    with pytest.raises(RuntimeError, match="apex is not importable"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5, backend="apex")
    with pytest.raises(RuntimeError, match="apex is not importable"):
        ops.apex.adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, backend="apex")


def test_apex_is_used_only_when_importable_and_on_cuda(monkeypatch):
    """A stand-in apex module: apex is taken for the norms it has, PyTorch for the rest; CPU tensors are refused."""
    monkeypatch.setattr(dispatch, "apex_importable", lambda: True)
    assert dispatch.choose_backend((torch.randn(2),), "apex", apex_has_op=False) == "torch"
    with pytest.raises(RuntimeError, match="need CUDA"):
        dispatch.choose_backend((torch.randn(2),), "apex", apex_has_op=True)
    calls = []
    fake = types.ModuleType("apex.normalization.fused_layer_norm")
    fake.fused_rms_norm_affine = lambda x, w, shape, eps: calls.append((tuple(shape), eps)) or x * w
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.normalization", types.ModuleType("apex.normalization"))
    monkeypatch.setitem(sys.modules, "apex.normalization.fused_layer_norm", fake)
    # stand in for CUDA tensors: the choice is checked above, here only that the apex function is called
    monkeypatch.setattr(ops.functional, "choose_backend", lambda tensors, backend, apex_has_op=False: "apex")
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, backend="apex")
    assert calls == [((4,), 1e-6)]


def test_without_apex_adamw_is_torch():
    opt = ops.apex.adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-3, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW


def test_distributed_tensors_take_pytorch(monkeypatch):
    monkeypatch.setattr(dispatch, "is_distributed", lambda t: True)
    assert dispatch.choose_backend((torch.randn(2),), "triton") == "torch"


def test_kernels_imported_before_the_interpreter_flag_are_reported():
    code = ("import os, torch\n"
            "import xscale_kernels.gated\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from xscale import ops\n"
            "try:\n"
            "    ops.gated_activation(torch.randn(4), torch.randn(4), 'silu', backend='triton')\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ".:kernels"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "imported before TRITON_INTERPRET=1 was set" in result.stdout, result.stdout + result.stderr
