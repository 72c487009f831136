"""Fused gated activation (SwiGLU / GeGLU / ReGLU) vs ``act(gate) * up``, forward and gradients."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops import reference
from xscale_kernels.gated import ACTIVATION_CODES, gated_activation


@pytest.mark.parametrize("activation", sorted(ACTIVATION_CODES))
@pytest.mark.parametrize("shape", [(3, 5, 67), (3, 7, 131)], ids=["one-block", "three-blocks-partial"])
def test_matches_reference(dtype, activation, shape):
    gate = (2 * torch.randn(shape)).to(dtype).requires_grad_()  # wide enough to reach both tails of each act
    up = torch.randn(shape, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, dtype=dtype)
    fused = gated_activation(gate, up, activation)
    want = reference.gated_activation(gate, up, activation)
    assert fused.dtype == want.dtype
    assert_close(fused, want, dtype, "output")
    got_grads = torch.autograd.grad(fused, [gate, up], grad_out)
    want_grads = torch.autograd.grad(want, [gate, up], grad_out)
    for got, expected, name in zip(got_grads, want_grads, ["gate", "up"]):
        assert got.dtype == expected.dtype
        assert_close(got, expected, dtype, f"grad {name}")


def test_gate_and_up_as_halves_of_one_projection(dtype):
    """``gate, up = (x W).chunk(2, -1)``: strided views, as a fused gate-up linear hands them over."""
    projected = torch.randn(4, 9, 2 * 45, dtype=dtype, requires_grad=True)
    gate, up = projected.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    grad_out = torch.randn(4, 9, 45, dtype=dtype)
    fused_grad, = torch.autograd.grad(gated_activation(gate, up, "silu"), projected, grad_out)
    want_grad, = torch.autograd.grad(reference.gated_activation(gate, up, "silu"), projected, grad_out)
    assert_close(gated_activation(gate, up, "silu"), reference.gated_activation(gate, up, "silu"), dtype, "output")
    assert_close(fused_grad, want_grad, dtype, "grad")


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="no fused kernel"):
        gated_activation(torch.randn(4), torch.randn(4), "swish")
