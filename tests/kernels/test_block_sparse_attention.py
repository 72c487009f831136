"""Block-sparse FlashAttention-style kernel vs dense softmax attention with the layout's mask."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops.block_sparse_attention import block_sparse_attention_reference, build_layout
from xscale_kernels.block_sparse_attention import BlockSparseAttention

BLOCK = 16


def _layout(seq_q, seq_k, heads, causal):
    """A random layout (per head when heads > 1) that always keeps the diagonal block, as local attention does."""
    n_q, n_k = -(-seq_q // BLOCK), -(-seq_k // BLOCK)
    keep = torch.rand(heads, n_q, n_k) < 0.5
    keep |= torch.eye(n_q, n_k, dtype=torch.bool)
    if causal:
        keep &= torch.ones(n_q, n_k, dtype=torch.bool).tril()
    count = keep.sum(-1).int()
    index = torch.full((heads, n_q, n_k), 0, dtype=torch.int32)
    for h in range(heads):
        for i in range(n_q):
            ids = keep[h, i].nonzero().flatten().flip(0)  # any order is accepted
            index[h, i, :len(ids)] = ids.int()
    return build_layout(index, count, BLOCK, seq_q, seq_k)


def _run(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, [q, k, v], grad_out))


@pytest.mark.parametrize(("causal", "layout_heads", "seq_k", "scale"),
                         [(True, 1, 40, None), (False, 2, 40, None), (False, 1, 53, None), (True, 2, 24, 0.3)],
                         ids=["causal-shared", "per-head", "longer-keys", "fewer-keys-causal-scaled"])
def test_matches_dense_reference(dtype, causal, layout_heads, seq_k, scale):
    batch, heads, seq_q, head_dim = 2, 2, 40, 24  # partial last block, head dim padded to 32 inside
    q = torch.randn(batch, heads, seq_q, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, heads, seq_k, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, heads, seq_k, head_dim, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(batch, heads, seq_q, head_dim, dtype=dtype)
    layout = _layout(seq_q, seq_k, layout_heads, causal)
    fused = _run(lambda q, k, v: BlockSparseAttention.apply(q, k, v, layout.index, layout.count,
                                                            layout.transposed_index, layout.transposed_count,
                                                            BLOCK, causal, scale), q, k, v, grad_out)
    want = _run(lambda q, k, v: block_sparse_attention_reference(q, k, v, layout, causal, scale), q, k, v,
                grad_out)
    for got, expected, name in zip(fused, want, ["output", "grad q", "grad k", "grad v"]):
        assert_close(got, expected, dtype, name)


def test_query_block_without_keys_outputs_zero():
    q, k, v = (torch.randn(1, 1, 32, 16) for _ in range(3))
    layout = build_layout(torch.tensor([[0], [0]], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
                          BLOCK, 32, 32)
    out = BlockSparseAttention.apply(q, k, v, layout.index, layout.count, layout.transposed_index,
                                     layout.transposed_count, BLOCK, False, None)
    assert out[..., 16:, :].abs().max() == 0
    assert_close(out, block_sparse_attention_reference(q, k, v, layout, False), torch.float32)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        build_layout(torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 24, 48, 48)
    with pytest.raises(ValueError, match="key block ids"):
        build_layout(torch.tensor([[0], [5]], dtype=torch.int32), torch.ones(2, dtype=torch.int32), 16, 32, 32)
    with pytest.raises(ValueError, match="twice"):
        build_layout(torch.tensor([[0, 0], [1, 0]], dtype=torch.int32), torch.full((2,), 2, dtype=torch.int32),
                     16, 32, 32)
