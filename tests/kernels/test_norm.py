"""Fused residual RMSNorm / LayerNorm kernels vs the PyTorch references, forward and gradients."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops import reference
from xscale_kernels.norm import residual_norm

SHAPE = (3, 7, 37)  # odd rows and a hidden size that is not a power of two
WIDE_SHAPE = (5, 1100)  # a row wider than 1024 (one program still holds the whole row)


def _inputs(dtype, with_residual, with_bias, shape=SHAPE, weight_dtype=torch.float32):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    residual = torch.randn(shape, dtype=dtype, requires_grad=True) if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(weight_dtype).requires_grad_()
    bias = torch.randn(shape[-1]).to(weight_dtype).requires_grad_() if with_bias else None
    return x, residual, weight, bias


def _reference(x, residual, weight, bias, is_rms):
    summed = x + residual if residual is not None else x
    normed = reference.rms_norm(summed, weight, 1e-5) if is_rms else reference.layer_norm(summed, weight, bias, 1e-5)
    return normed, summed


def _check(dtype, kind, with_residual, shape=SHAPE, weight_dtype=torch.float32):
    is_rms = kind == "rms"
    x, residual, weight, bias = _inputs(dtype, with_residual, kind == "layer", shape, weight_dtype)
    leaves = [t for t in (x, residual, weight, bias) if t is not None]
    grad_y = torch.randn(shape, dtype=dtype)
    grad_s = torch.randn(shape, dtype=dtype)

    def run(fn):
        out = fn(x, residual, weight, bias)
        normed, summed = out if with_residual else (out, None)
        loss = (normed.float() * grad_y.float()).sum()
        if with_residual:
            loss = loss + (summed.float() * grad_s.float()).sum()
        grads = torch.autograd.grad(loss, leaves)
        return normed, summed, grads

    fused = run(lambda *a: residual_norm(*a, 1e-5, is_rms))
    expected = run(lambda x, r, w, b: _reference(x, r, w, b, is_rms) if with_residual
                   else _reference(x, r, w, b, is_rms)[0])
    assert fused[0].dtype == expected[0].dtype
    assert_close(fused[0], expected[0], dtype, "normed")
    if with_residual:
        # fp32: exact. bf16: within one bf16 step (2^-7 relative), because triton 3.9's interpreter casts
        # fp32 -> bf16 by truncation where the GPU (and PyTorch) round to nearest even.
        bound = 0.0 if dtype == torch.float32 else 2.0**-7
        error = (fused[1].float() - expected[1].float()).abs() - bound * expected[1].float().abs()
        assert error.max().item() <= 0.0, "the new residual must be x + residual"
    for got, want, name in zip(fused[2], expected[2], ["x", "residual", "weight", "bias"][:len(leaves)]):
        assert got.dtype == want.dtype, f"grad {name} dtype"
        assert_close(got, want, dtype, f"grad {name}")


@pytest.mark.parametrize("kind", ["rms", "layer", "layer-no-bias"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_matches_reference(dtype, kind, with_residual):
    _check(dtype, kind, with_residual)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_wide_rows_and_weights_in_the_input_dtype(dtype, kind):
    """Hidden 1100 (> 1024, not a power of two); weights stored in bf16 too, as in a pure-bf16 model."""
    _check(dtype, kind, with_residual=True, shape=WIDE_SHAPE, weight_dtype=dtype)


def test_unused_residual_output_gets_no_gradient_term():
    x, residual, weight, _ = _inputs(torch.float32, True, False)
    normed, _ = residual_norm(x, residual, weight, None, 1e-5, True)
    grad_x, = torch.autograd.grad(normed.sum(), [x])
    want, = torch.autograd.grad(reference.rms_norm(x + residual, weight, 1e-5).sum(), [x])
    assert_close(grad_x, want, torch.float32, "grad x")


def test_residual_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="residual"):
        residual_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), None, 1e-5, True)
