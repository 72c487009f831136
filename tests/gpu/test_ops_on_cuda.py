"""GPU-only paths of xscale.ops: block-sparse attention through FlexAttention's BlockMask (compiled) against the
Triton kernel and the masked dense reference, forward and gradients; MoE experts through ``torch._grouped_mm``;
fused AdamW; each SDPA backend pinned."""

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import DEVICE, DRY_RUN, cosine, gpu, relative_error

from xscale.ops import block_sparse_attention
from xscale.ops.block_sparse_attention import block_sparse_attention_reference, build_layout
from xscale.ops.grouped_mlp import ExpertWeights, grouped_mlp
from xscale.ops.grouped_mm_mlp import grouped_mm_applies, grouped_mm_mlp
from xscale.parallel.sdpa_backend import sdpa_backend_context

pytestmark = [*gpu, pytest.mark.skipif(DRY_RUN, reason="FlexAttention's backward and grouped GEMMs need CUDA")]
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def _local_layout(seq: int, block: int, window_blocks: int):
    """Sliding window (Beltagy et al. 2020) plus a global first block, in blocks."""
    n = -(-seq // block)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for row in range(n):
        mask[row, max(0, row - window_blocks):row + 1] = True
    mask[:, 0] = True
    count = mask.sum(-1)
    index = torch.where(mask, torch.arange(n), n).sort(-1).values[:, :int(count.max())].clamp_max(n - 1)
    return build_layout(index.to(DEVICE), count.to(DEVICE), block, seq, seq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq,block,causal", [(1000, 64, True), (512, 128, True), (777, 64, False)])
def test_flex_triton_and_reference_agree_forward_and_backward(dtype, seq, block, causal):
    layout = _local_layout(seq, block, window_blocks=3)
    q, k, v = (torch.randn(2, 3, seq, 64, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 3, seq, 64, device=DEVICE, dtype=dtype)
    results = {}
    for backend in ("flex", "triton", "torch"):
        out = block_sparse_attention(q, k, v, layout, causal=causal, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    want = (block_sparse_attention_reference(q, k, v, layout, causal), *results["torch"][1:])
    for backend in ("flex", "triton"):
        for name, got, expected in zip(("out", "dq", "dk", "dv"), results[backend], want):
            error = relative_error(got, expected)
            assert error < TOLERANCE[dtype], f"{backend} {name}: {error:.3g}"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "mlp"])
def test_grouped_mm_experts_match_the_per_expert_path_in_bf16(gated):
    counts, d, hidden = [37, 0, 128, 5, 90], 64, 96
    experts = len(counts)

    def weight(*shape):
        return (0.1 * torch.randn(*shape, device=DEVICE)).requires_grad_()

    weights = ExpertWeights(weight(experts, hidden, d), weight(experts, hidden), weight(experts, hidden, d) if gated
                            else None, None, weight(experts, d, hidden), weight(experts, d), "silu" if gated else "gelu")
    x = torch.randn(sum(counts), d, device=DEVICE, requires_grad=True)
    leaves = [t for t in (x, weights.w1, weights.b1, weights.w_up, weights.w2, weights.b2) if t is not None]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert grouped_mm_applies(x, weights)
        got = grouped_mm_mlp(x, counts, weights)
        want = grouped_mlp(x, counts, weights.activation, weights.w1, weights.b1, weights.w2, weights.b2,
                           weights.w_up, weights.b_up)
    assert got.dtype == want.dtype == torch.bfloat16
    assert relative_error(got, want) < 2e-2
    for got_grad, want_grad in zip(torch.autograd.grad(got.float().square().sum(), leaves),
                                   torch.autograd.grad(want.float().square().sum(), leaves)):
        assert cosine(got_grad, want_grad) > 0.999


def test_fused_adamw_matches_the_foreach_update():
    from xscale.config.schema import TrainConfig
    from xscale.train.optim import build_optimizer

    params = [torch.randn(33, 17, device=DEVICE, requires_grad=True) for _ in range(3)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    fused = build_optimizer(params, TrainConfig(lr=1e-2))
    foreach = build_optimizer(copies, TrainConfig(lr=1e-2, optimizer_foreach=True))
    assert fused.param_groups[0]["fused"] and not foreach.param_groups[0].get("fused")
    for _ in range(3):
        for group in (params, copies):
            for p in group:
                p.grad = torch.ones_like(p) * p.detach().sin()
        fused.step()
        foreach.step()
    for a, b in zip(params, copies):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
def test_each_sdpa_backend_pinned_runs_and_agrees(backend):
    q, k, v = (torch.randn(2, 4, 300, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_backend_context("math"):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    with sdpa_backend_context(backend):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got.sum().backward()
    assert relative_error(got, want) < 2e-2
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
