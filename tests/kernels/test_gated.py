"""Fused gated activation (SwiGLU / GeGLU / ReGLU) vs ``act(gate) * up``, forward and gradients."""

import pytest
import torch
from conftest import assert_close

from xscale.ops import reference
from xscale_kernels.gated import ACTIVATION_CODES, gated_activation


@pytest.mark.parametrize("activation", sorted(ACTIVATION_CODES))
def test_matches_reference(dtype, activation):
    gate = (2 * torch.randn(3, 5, 67)).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 67, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(3, 5, 67, dtype=dtype)
    fused = gated_activation(gate, up, activation)
    want = reference.gated_activation(gate, up, activation)
    assert fused.dtype == want.dtype
    assert_close(fused, want, dtype, "output")
    got_grads = torch.autograd.grad(fused, [gate, up], grad_out)
    want_grads = torch.autograd.grad(want, [gate, up], grad_out)
    for got, expected, name in zip(got_grads, want_grads, ["gate", "up"]):
        assert_close(got, expected, dtype, f"grad {name}")


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="no fused kernel"):
        gated_activation(torch.randn(4), torch.randn(4), "swish")
