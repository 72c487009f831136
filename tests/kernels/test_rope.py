"""Fused RoPE (half-split form) vs ``x * cos + rotate_half(x) * sin``, forward and gradient."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops import reference
from xscale_kernels.rope import apply_rope


def _tables(seq_len, head_dim):
    angles = torch.rand(seq_len, head_dim // 2) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("head_dim", [12, 10], ids=["hd12", "hd10-odd-half"])
def test_matches_reference(dtype, head_dim):
    x = torch.randn(2, 3, 11, head_dim, dtype=dtype, requires_grad=True)
    cos, sin = _tables(11, head_dim)
    grad_out = torch.randn(2, 3, 11, head_dim, dtype=dtype)
    fused = apply_rope(x, cos, sin)
    want = reference.apply_rope(x, cos, sin)
    assert_close(fused, want, dtype, "output")
    assert_close(torch.autograd.grad(fused, x, grad_out)[0], torch.autograd.grad(want, x, grad_out)[0], dtype, "grad")


def test_non_contiguous_input_and_broadcast_tables(dtype):
    source = torch.randn(2, 11, 3, 12, dtype=dtype, requires_grad=True)
    x = source.transpose(1, 2)  # (B, H, T, hd) view, as after a head split
    cos, sin = _tables(11, 12)
    grad_out = torch.randn(2, 3, 11, 12, dtype=dtype)
    fused = apply_rope(x, cos[None, None], sin[None, None])
    want = reference.apply_rope(x, cos, sin)
    assert_close(fused, want, dtype, "output")
    assert_close(torch.autograd.grad(fused, source, grad_out)[0], torch.autograd.grad(want, source, grad_out)[0],
                 dtype, "grad")


def test_bad_tables_are_refused():
    cos, sin = _tables(5, 12)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(torch.randn(1, 1, 11, 12), cos, sin)
