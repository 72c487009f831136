"""The model-level ops give the same values and gradients under train.kernels 'triton' (interpreter) and 'torch'."""

import pytest
import torch

from xscale import ops
from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.parallel.model import ParallelModel
from xscale.train.step import forward_backward_step

# fp32 kernels vs fp32 PyTorch: same math, other summation order
TOLERANCE = 1e-5


def _both_backends(fn, *inputs):
    results = {}
    for backend in ("torch", "triton"):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = fn(*leaves, backend=backend)
        out_sum = sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in
                      (out if isinstance(out, tuple) else (out,)))
        grads = torch.autograd.grad(out_sum, [t for t in leaves if t.requires_grad])
        results[backend] = (out if isinstance(out, tuple) else (out,)), grads
    return results["torch"], results["triton"]


def _assert_same(reference, fused):
    for want, got in zip(reference[0] + reference[1], fused[0] + fused[1]):
        scale = max(want.abs().max().item(), 1.0)
        assert (got - want).abs().max().item() <= TOLERANCE * scale


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_residual", "layer_norm", "layer_norm_residual", "apply_rope",
                                "gated_activation", "linear_cross_entropy_sum"])
def test_op_parity(op):
    x = torch.randn(2, 3, 9, 20, requires_grad=True)
    other = torch.randn(2, 3, 9, 20, requires_grad=True)
    weight = torch.randn(20, requires_grad=True)
    angles = torch.randn(9, 10)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    labels = torch.arange(54).view(2, 27) % 37
    cases = {
        "rms_norm": (lambda x, w, backend: ops.rms_norm(x, w, 1e-5, backend=backend), x, weight),
        "rms_norm_residual": (lambda x, r, w, backend: ops.rms_norm_residual(x, r, w, 1e-5, backend=backend),
                              x, other, weight),
        "layer_norm": (lambda x, w, backend: ops.layer_norm(x, w, None, 1e-5, backend=backend), x, weight),
        "layer_norm_residual": (lambda x, r, w, b, backend: ops.layer_norm_residual(x, r, w, b, 1e-5, backend=backend),
                                x, other, weight, torch.randn(20, requires_grad=True)),
        "apply_rope": (lambda x, backend: ops.apply_rope(x, cos, sin, backend=backend), x),
        "gated_activation": (lambda g, u, backend: ops.gated_activation(g, u, "silu", backend=backend), x, other),
        "linear_cross_entropy_sum": (lambda h, w, backend: ops.linear_cross_entropy_sum(h, w, labels, backend=backend),
                                     torch.randn(2, 27, 20, requires_grad=True),
                                     torch.randn(37, 20, requires_grad=True)),
    }
    fn, *inputs = cases[op]
    _assert_same(*_both_backends(fn, *inputs))


def test_moe_permute_parity():
    expert_ids = torch.randn(11, 6).topk(2, dim=-1).indices

    def permute_then_unpermute(tokens, gates, backend):
        permuted, plan = ops.moe_permute(tokens, expert_ids, 6, backend=backend)
        scaled = permuted * torch.linspace(0.5, 2, permuted.shape[0])[:, None]
        return permuted, ops.moe_unpermute(scaled, plan, gates, backend=backend)

    _assert_same(*_both_backends(permute_then_unpermute, torch.randn(11, 19, requires_grad=True),
                                 torch.rand(11, 2, requires_grad=True)))


def test_block_sparse_attention_parity_with_grouped_kv_heads():
    """4 query heads on 2 key/value heads (the wrapper repeats k/v), a causal local layout, a given scale."""
    n_blocks = 3
    index = torch.tensor([[0, 0], [0, 1], [1, 2]], dtype=torch.int32)
    layout = ops.build_layout(index, torch.tensor([1, 2, 2], dtype=torch.int32), 16, 40, 40)
    assert layout.mask.shape == (1, n_blocks, n_blocks)

    def attend(q, k, v, backend):
        return ops.block_sparse_attention(q, k, v, layout, causal=True, scale=0.2, backend=backend)

    _assert_same(*_both_backends(attend, torch.randn(1, 4, 40, 16, requires_grad=True),
                                 torch.randn(1, 2, 40, 16, requires_grad=True),
                                 torch.randn(1, 2, 40, 16, requires_grad=True)))


def test_llama_style_train_step_parity(monkeypatch):
    """A 2-layer RMSNorm + RoPE + SwiGLU decoder: one train step's loss and gradients match across backends, and
    ``use_kernels("triton")`` really runs the kernels (norm, rope, gated activation, the fused loss)."""
    used = []
    kernel_module = ops.functional.kernel_module
    monkeypatch.setattr(ops.functional, "kernel_module", lambda name: used.append(name) or kernel_module(name))
    config = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    batch = {"input_ids": torch.randint(0, 61, (2, 12)), "labels": torch.randint(0, 61, (2, 12))}
    batch["labels"][0, :4] = -100
    results = {}
    for backend in ("torch", "triton"):
        model = build_model(config, seed=3).use_kernels(backend)
        loss = forward_backward_step(ParallelModel([model], micro_batch_size=1), batch)
        results[backend] = loss, {name: p.grad.clone() for name, p in model.named_parameters()}
    assert {"norm", "rope", "gated", "cross_entropy"} <= set(used)
    (loss_ref, grads_ref), (loss_fused, grads_fused) = results["torch"], results["triton"]
    assert abs(loss_ref.item() - loss_fused.item()) <= TOLERANCE * loss_ref.item()
    for name, grad in grads_ref.items():
        scale = max(grad.abs().max().item(), 1e-3)
        assert (grads_fused[name] - grad).abs().max().item() <= 1e-4 * scale, name
