"""The pure-PyTorch chunked linear cross-entropy (the CPU path under ``auto``) vs the unfused loss."""

import pytest
import torch

from xscale.ops import reference
from xscale.ops.chunked_cross_entropy import TorchRowLoss, chunked_linear_cross_entropy_sum

# fp32: same math, sums in another order. bf16: chunked dW partial sums are rounded per chunk.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(dtype):
    hidden = torch.randn(3, 17, 24, dtype=dtype, requires_grad=True)
    weight = torch.randn(997, 24, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 997, (3, 17))
    labels[1, ::3] = -100
    return hidden, weight, labels


def _check(got, want, dtype, what):
    scale = max(want.detach().float().abs().max().item(), 1.0)
    error = (got.detach().float() - want.detach().float()).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"{what}: {error:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_tokens", [4, 10, None])
def test_matches_unfused(dtype, chunk_tokens):
    hidden, weight, labels = _problem(dtype)
    got = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens)
    want = reference.linear_cross_entropy_sum(hidden, weight, labels)
    _check(got, want, dtype, "loss")
    for g, w, name in zip(torch.autograd.grad(got * 3, [hidden, weight]), torch.autograd.grad(want * 3, [hidden, weight]),
                          ["hidden", "weight"]):
        assert g.dtype == w.dtype
        _check(g, w, dtype, f"grad {name}")


def test_autocast_matches_unfused_under_autocast():
    hidden, weight, labels = _problem(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=8)
        want = reference.linear_cross_entropy_sum(hidden, weight, labels)
    _check(got, want, torch.bfloat16, "loss")
    for g, w, name in zip(torch.autograd.grad(got, [hidden, weight]), torch.autograd.grad(want, [hidden, weight]),
                          ["hidden", "weight"]):
        assert g.dtype == torch.float32
        _check(g, w, torch.bfloat16, f"grad {name}")


def test_rows_with_extreme_logits():
    """The in-place row log-sum-exp and softmax where a naive exp would overflow or give nan."""
    logits = torch.tensor([[1e4, -1e4, 0.0], [-float("inf"), 3.0, 2.0], [0.5, 0.5, 0.5]])
    labels = torch.tensor([1, 2, -100])
    rows = TorchRowLoss()
    loss, lse = rows.forward(logits.clone(), labels)
    leaf = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(leaf, labels, reduction="none")
    assert torch.allclose(loss, want) and torch.allclose(lse, torch.logsumexp(logits, -1))
    want_grad, = torch.autograd.grad(want.sum() * 0.5, leaf)
    got_grad = rows.backward(logits.clone(), labels, lse, torch.tensor(0.5))
    assert torch.isfinite(got_grad).all() and torch.allclose(got_grad, want_grad)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        chunked_linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="cast one"):
        chunked_linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(10, 8, dtype=torch.bfloat16),
                                         torch.zeros(4, dtype=torch.long))
