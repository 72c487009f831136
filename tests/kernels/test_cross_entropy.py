"""Chunked linear cross-entropy with Triton softmax rows vs the unfused ``CE(hidden @ W^T)``."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops import reference
from xscale_kernels.cross_entropy import TritonRowLoss, linear_cross_entropy_sum


def _problem(dtype, vocab=1301, tokens=(2, 19), width=16):
    hidden = torch.randn(*tokens, width, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, tokens)
    labels[0, :3] = -100
    labels[1, -1] = vocab - 1
    return hidden, weight, labels


@pytest.mark.parametrize("gradient_in_forward", [True, False], ids=["gradient-in-forward", "recomputed"])
@pytest.mark.parametrize(("vocab", "chunk_tokens"), [(1301, 7), (1301, None), (37, 5)],
                         ids=["chunks-of-7", "one-chunk", "vocab-below-one-block"])
def test_matches_reference(dtype, vocab, chunk_tokens, gradient_in_forward):
    """vocab 1301: two vocab blocks of 1024, the second partial; 38 tokens: the last chunk partial."""
    hidden, weight, labels = _problem(dtype, vocab)
    fused = linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens, gradient_in_forward)
    want = reference.linear_cross_entropy_sum(hidden, weight, labels)
    assert fused.dtype == torch.float32
    assert_close(fused, want, dtype, "loss")
    for got, expected, name in zip(torch.autograd.grad(fused * 0.5, [hidden, weight]),
                                   torch.autograd.grad(want * 0.5, [hidden, weight]), ["hidden", "weight"]):
        assert got.dtype == expected.dtype
        assert_close(got, expected, dtype, f"grad {name}")


def test_all_tokens_ignored_gives_zero_loss_and_gradients():
    hidden, weight, labels = _problem(torch.float32)
    labels.fill_(-100)
    loss = linear_cross_entropy_sum(hidden, weight, labels, 5)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_rows_with_extreme_logits():
    """Forward and backward of the row kernels where a naive exp would overflow or produce nan."""
    logits = torch.tensor([[1e4, -1e4, 0.0], [-float("inf"), 3.0, 2.0], [0.5, 0.5, 0.5]])
    labels = torch.tensor([1, 2, -100])
    rows = TritonRowLoss()
    loss, lse = rows.forward(logits, labels)
    leaf = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(leaf, labels, reduction="none")
    assert torch.allclose(loss, want) and torch.allclose(lse, torch.logsumexp(logits, -1))
    want_grad, = torch.autograd.grad(want.sum() * 0.5, leaf)
    got_grad = rows.backward(logits.clone(), labels, lse, torch.tensor(0.5))
    assert torch.isfinite(got_grad).all() and torch.allclose(got_grad, want_grad)
    one_pass_loss, one_pass_lse, one_pass_grad = rows.forward_backward(logits.clone(), labels)
    assert torch.allclose(one_pass_loss, want) and torch.allclose(one_pass_lse, lse)
    assert torch.allclose(one_pass_grad * 0.5, want_grad)


def test_row_kernels_on_padded_rows_read_and_write_only_the_vocabulary():
    """The chunk loop hands the kernels rows stride(0) apart (padded to ROW_ALIGNMENT): the padding, filled with nan,
    is neither read (finite loss) nor written, and the results equal the contiguous rows'."""
    logits = torch.randn(5, 37)
    labels = torch.tensor([0, 36, -100, 7, 20])
    buffer = torch.full((5, 64), float("nan"))
    padded = buffer[:, :37]
    padded.copy_(logits)
    rows = TritonRowLoss()
    loss, lse = rows.forward(padded, labels)
    want_loss, want_lse = rows.forward(logits.clone(), labels)
    assert torch.isfinite(loss).all() and torch.equal(loss, want_loss) and torch.equal(lse, want_lse)
    got = rows.backward(padded, labels, lse, torch.tensor(2.0))
    want = rows.backward(logits.clone(), labels, lse, torch.tensor(2.0))
    assert got.data_ptr() == buffer.data_ptr() and got.stride() == (64, 1) and torch.equal(got, want)
    assert buffer[:, 37:].isnan().all()
