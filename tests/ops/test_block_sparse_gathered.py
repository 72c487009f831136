"""The gathered PyTorch block-sparse attention (the CPU path under ``auto``) vs dense masked attention."""

import pytest
import torch

from xscale import ops
from xscale.ops.block_sparse_attention import (
    block_sparse_attention_gathered,
    block_sparse_attention_reference,
    build_layout,
)

BLOCK = 16
# fp32: same math, sums in another order. bf16 inputs: both compute in float32 and round the output once.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _random_layout(seq_q, seq_k, heads, causal, empty_block=None):
    """Random key blocks per query block (per head when heads > 1), the diagonal always kept unless emptied."""
    n_q, n_k = -(-seq_q // BLOCK), -(-seq_k // BLOCK)
    keep = (torch.rand(heads, n_q, n_k) < 0.5) | torch.eye(n_q, n_k, dtype=torch.bool)
    if causal:
        keep &= torch.ones(n_q, n_k, dtype=torch.bool).tril()
    if empty_block is not None:
        keep[:, empty_block] = False
    count = keep.sum(-1).int()
    index = torch.zeros(heads, n_q, max(int(count.max()), 1), dtype=torch.int32)
    for h in range(heads):
        for i in range(n_q):
            ids = keep[h, i].nonzero().flatten().flip(0)  # any order is accepted
            index[h, i, :len(ids)] = ids.int()
    return build_layout(index, count, BLOCK, seq_q, seq_k)


def _check(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    scale = max(want.detach().float().abs().max().item(), 1.0)
    error = (got.detach().float() - want.detach().float()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"{what}: {error:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("causal", "layout_heads", "seq_q", "seq_k", "scale"),
                         [(True, 1, 40, 40, None), (False, 3, 40, 53, None), (True, 3, 50, 24, 0.3)],
                         ids=["causal-shared", "per-head-longer-keys", "causal-per-head-fewer-keys-scaled"])
def test_matches_dense_reference(dtype, causal, layout_heads, seq_q, seq_k, scale):
    torch.manual_seed(0)
    layout = _random_layout(seq_q, seq_k, layout_heads, causal)
    q = torch.randn(2, 3, seq_q, 24, dtype=dtype, requires_grad=True)  # 24: not a power of two
    k = torch.randn(2, 3, seq_k, 24, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, seq_k, 24, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(2, 3, seq_q, 24, dtype=dtype)
    got = block_sparse_attention_gathered(q, k, v, layout, causal, scale)
    want = block_sparse_attention_reference(q, k, v, layout, causal, scale)
    _check(got, want, dtype, "output")
    for g, w, name in zip(torch.autograd.grad(got, [q, k, v], grad_out),
                          torch.autograd.grad(want, [q, k, v], grad_out), "qkv"):
        _check(g, w, dtype, f"grad {name}")


def test_query_block_without_keys_gives_zero_output_and_finite_gradients():
    torch.manual_seed(0)
    layout = _random_layout(48, 48, 1, causal=False, empty_block=1)
    q, k, v = (torch.randn(1, 2, 48, 16, requires_grad=True) for _ in range(3))
    out = block_sparse_attention_gathered(q, k, v, layout, False)
    assert out[:, :, 16:32].abs().max() == 0
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[0][:, :, 16:32].abs().max() == 0
    _check(out, block_sparse_attention_reference(q, k, v, layout, False), torch.float32, "output")


def test_auto_on_cpu_takes_the_gathered_path_and_torch_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(ops.functional, "block_sparse_attention_gathered", lambda *a: calls.append("gathered"))
    monkeypatch.setattr(ops.functional, "block_sparse_attention_reference", lambda *a: calls.append("reference"))
    layout = _random_layout(32, 32, 1, causal=True)
    q = torch.randn(1, 2, 32, 16)
    for backend in ("auto", "torch"):
        ops.block_sparse_attention(q, q, q, layout, causal=True, backend=backend)
    assert calls == ["gathered", "reference"]


def test_memory_grows_with_the_listed_blocks_not_with_length_squared():
    """Local attention (each block sees itself and the one before): doubling T doubles the gathered path's
    peak allocation (forward + backward) and quadruples the dense reference's."""
    from xscale.bench.kernels import local_layout, peak_cpu_allocation

    def peaks(length):
        layout = local_layout(length, BLOCK, torch.device("cpu"))
        q, k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(3))
        return [peak_cpu_allocation(lambda fn=fn: fn(q, k, v, layout, True).sum().backward())
                for fn in (block_sparse_attention_gathered, block_sparse_attention_reference)]

    (gathered_short, dense_short), (gathered_long, dense_long) = peaks(512), peaks(1024)
    assert gathered_long <= 2.2 * gathered_short
    assert dense_long >= 3.5 * dense_short
    assert gathered_long * 4 <= dense_long
