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


@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["gradient-in-forward", "recomputed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_tokens", [4, 10, None])
def test_matches_unfused(dtype, chunk_tokens, gradient_in_forward):
    hidden, weight, labels = _problem(dtype)
    got = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens,
                                           gradient_in_forward=gradient_in_forward)
    want = reference.linear_cross_entropy_sum(hidden, weight, labels)
    _check(got, want, dtype, "loss")
    for g, w, name in zip(torch.autograd.grad(got * 3, [hidden, weight]), torch.autograd.grad(want * 3, [hidden, weight]),
                          ["hidden", "weight"]):
        assert g.dtype == w.dtype
        _check(g, w, dtype, f"grad {name}")


@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["gradient-in-forward", "recomputed"])
def test_autocast_matches_unfused_under_autocast(gradient_in_forward):
    hidden, weight, labels = _problem(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=8,
                                               gradient_in_forward=gradient_in_forward)
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


def test_forward_backward_rows_equal_forward_then_backward():
    """The one-pass rows (softmax from the row sums of the shifted exp) against the two-pass ones at grad 1."""
    logits = torch.tensor([[1e4, -1e4, 0.0], [-float("inf"), 3.0, 2.0], [0.5, 0.5, 0.5], [2.0, -1.0, 7.0]])
    labels = torch.tensor([1, 2, -100, 0])
    rows = TorchRowLoss()
    loss, lse, dlogits = rows.forward_backward(logits.clone(), labels)
    want_loss, want_lse = rows.forward(logits.clone(), labels)
    want_dlogits = rows.backward(logits.clone(), labels, want_lse, torch.tensor(1.0))
    assert torch.equal(loss, want_loss) and torch.equal(lse, want_lse)
    assert torch.allclose(dlogits, want_dlogits, rtol=1e-6, atol=1e-7)


class CountingRowLoss(TorchRowLoss):
    """Counts the passes over each chunk's logits (each one follows a (chunk x vocab) matmul)."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0, "forward_backward": 0}

    def forward(self, logits, labels):
        self.calls["forward"] += 1
        return super().forward(logits, labels)

    def backward(self, logits, labels, lse, grad):
        self.calls["backward"] += 1
        return super().backward(logits, labels, lse, grad)

    def forward_backward(self, logits, labels):
        self.calls["forward_backward"] += 1
        return TorchRowLoss.forward_backward(self, logits, labels)


def test_a_training_step_computes_each_chunks_logits_once():
    """With the gradient made in the forward, a forward and backward compute the logits of each of the 5 chunks
    once (the recomputing path: twice); under no_grad, or on inputs that need no gradient, no gradient is made."""
    hidden, weight, labels = _problem(torch.float32)  # 51 tokens: chunks of 11 -> 5
    rows = CountingRowLoss()
    chunked_linear_cross_entropy_sum(hidden, weight, labels, rows, chunk_tokens=11).backward()
    assert rows.calls == {"forward": 0, "backward": 0, "forward_backward": 5}
    rows = CountingRowLoss()
    chunked_linear_cross_entropy_sum(hidden, weight, labels, rows, chunk_tokens=11,
                                     gradient_in_forward=False).backward()
    assert rows.calls == {"forward": 5, "backward": 5, "forward_backward": 0}
    for no_gradient in (torch.no_grad(), torch.enable_grad()):
        rows = CountingRowLoss()
        with no_gradient:
            inputs = (hidden, weight) if isinstance(no_gradient, torch.no_grad) else (hidden.detach(), weight.detach())
            loss = chunked_linear_cross_entropy_sum(*inputs, labels, rows, chunk_tokens=11)
        assert rows.calls == {"forward": 5, "backward": 0, "forward_backward": 0}
        assert torch.allclose(loss, reference.linear_cross_entropy_sum(hidden, weight, labels).detach())


def test_gradient_in_forward_takes_one_backward():
    """The gradient made in the forward is scaled in place by the backward: a second backward through the same
    graph is refused with what to do, and the recomputing path takes it."""
    hidden, weight, labels = _problem(torch.float32)
    loss = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="gradient_in_forward=False"):
        loss.backward()
    hidden.grad = weight.grad = None
    loss = chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=8, gradient_in_forward=False)
    loss.backward(retain_graph=True)
    once = hidden.grad.clone()
    loss.backward()
    assert torch.allclose(hidden.grad, 2 * once)


def test_only_the_gradients_asked_for_are_made():
    hidden, weight, labels = _problem(torch.float32)
    loss = chunked_linear_cross_entropy_sum(hidden, weight.detach(), labels, chunk_tokens=8)
    grad_hidden, = torch.autograd.grad(loss, [hidden])
    want, = torch.autograd.grad(reference.linear_cross_entropy_sum(hidden, weight.detach(), labels), [hidden])
    assert torch.allclose(grad_hidden, want, atol=1e-5)


@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["gradient-in-forward", "recomputed"])
def test_no_tokens_give_zero_loss_and_gradients(gradient_in_forward):
    """dW is written by the first chunk's product, not zeroed first: a pass over no tokens still gives zeros."""
    hidden = torch.randn(0, 24, requires_grad=True)
    weight = torch.randn(97, 24, requires_grad=True)
    loss = chunked_linear_cross_entropy_sum(hidden, weight, torch.zeros(0, dtype=torch.long),
                                            gradient_in_forward=gradient_in_forward)
    loss.backward()
    assert loss.item() == 0.0 and weight.grad.shape == weight.shape and not weight.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dw_is_written_by_the_first_chunk_whatever_its_buffer_held(monkeypatch, dtype):
    """The float32 dW buffer is allocated without a memset: filled with nan, the gradients still match."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    hidden, weight, labels = _problem(dtype)
    want = torch.autograd.grad(reference.linear_cross_entropy_sum(hidden, weight, labels), [weight])[0]
    monkeypatch.setattr(torch, "empty", nan_empty)
    got = torch.autograd.grad(chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=8), [weight])[0]
    _check(got, want, dtype, "grad weight")


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        chunked_linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="cast one"):
        chunked_linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(10, 8, dtype=torch.bfloat16),
                                         torch.zeros(4, dtype=torch.long))


class LayoutRecordingRowLoss(TorchRowLoss):
    """Records the row stride of the logits it gets and whether the gradient rows come back in the same buffer."""

    def __init__(self):
        self.strides, self.in_place = set(), []

    def forward_backward(self, logits, labels):
        self.strides.add(logits.stride())
        loss, lse, rows = super().forward_backward(logits, labels)
        self.in_place.append(rows.data_ptr() == logits.data_ptr() and rows.stride() == logits.stride())
        return loss, lse, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logit_rows_are_aligned_for_an_odd_vocabulary(dtype):
    """vocab 997: each chunk's logits are rows 1024 elements apart (ROW_ALIGNMENT), so the GEMMs that write and read
    them get an aligned leading dimension; the gradient rows are written back into that buffer, and the loss and
    gradients still match the unfused loss."""
    from xscale.ops.chunked_cross_entropy import ROW_ALIGNMENT, padded_row_length

    assert padded_row_length(997) == 1024 and padded_row_length(1024) == 1024 and ROW_ALIGNMENT == 64
    hidden, weight, labels = _problem(dtype)
    rows = LayoutRecordingRowLoss()
    got = chunked_linear_cross_entropy_sum(hidden, weight, labels, rows, chunk_tokens=8)
    assert rows.strides == {(1024, 1)} and all(rows.in_place) and len(rows.in_place) == 7
    want = reference.linear_cross_entropy_sum(hidden, weight, labels)
    _check(got, want, dtype, "loss")
    for g, w, name in zip(torch.autograd.grad(got, [hidden, weight]), torch.autograd.grad(want, [hidden, weight]),
                          ["hidden", "weight"]):
        _check(g, w, dtype, f"grad {name}")


def _over_reading_matmul(original):
    """A GEMM that reads each row of a padded-row input up to its stride, against zero-padded rows of the other
    matrix, as a bf16 kernel taking K in pairs does (AVX-512 BF16, AMX) when K (the vocabulary) is odd."""

    def matmul(a, b, *, out=None):
        if a.dim() == 2 and b.dim() == 2 and a.stride(1) == 1 and a.stride(0) > a.shape[1]:
            width = a.stride(0)
            a = a.as_strided((a.shape[0], width), (width, 1))
            b = torch.cat([b, b.new_zeros(width - b.shape[0], b.shape[1])])
        return original(a, b, out=out)

    return matmul


def _poisoned_new_empty(original):
    """Fresh buffers full of NaN: what uninitialised memory may hold."""

    def new_empty(self, *args, **kwargs):
        return original(self, *args, **kwargs).fill_(float("nan"))

    return new_empty


@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["gradient-in-forward", "recomputed"])
def test_padded_logit_columns_never_reach_the_gradient(monkeypatch, gradient_in_forward):
    """bf16, one chunk: NaN left in the padding of the logits buffer, read by a pair-wise GEMM, stays out of dh."""
    hidden, weight, labels = _problem(torch.bfloat16)
    want = torch.autograd.grad(reference.linear_cross_entropy_sum(hidden, weight, labels), [hidden])[0]
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned_new_empty(torch.Tensor.new_empty))
    monkeypatch.setattr(torch, "matmul", _over_reading_matmul(torch.matmul))
    got = chunked_linear_cross_entropy_sum(hidden, weight, labels, gradient_in_forward=gradient_in_forward)
    grad_hidden, = torch.autograd.grad(got, [hidden])
    assert torch.isfinite(grad_hidden).all()
    _check(grad_hidden, want, torch.bfloat16, "grad hidden")
