"""grouped_mlp: outputs and every gradient equal the project's FFN applied per expert on its rows."""

import pytest
import torch
import torch.nn.functional as F

from xscale.ops.grouped_mlp import grouped_mlp
from xscale.ops.reference import ACTIVATIONS

COUNTS = [3, 0, 5, 1, 4]  # expert 1 receives nothing: its gradients must be zero, not garbage


def per_expert_reference(x, counts, activation, w1, b1, w2, b2, w_up=None, b_up=None):
    def bias(b, e):
        return None if b is None else b[e]

    outputs = []
    for e, chunk in enumerate(x.split(counts)):
        hidden = ACTIVATIONS[activation](F.linear(chunk, w1[e], bias(b1, e)))
        if w_up is not None:
            hidden = hidden * F.linear(chunk, w_up[e], bias(b_up, e))
        outputs.append(F.linear(hidden, w2[e], bias(b2, e)))
    return torch.cat(outputs)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
@pytest.mark.parametrize("gated", [False, True], ids=["mlp", "gated"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_one_ffn_per_expert_forward_and_backward(activation, gated, with_bias):
    torch.manual_seed(0)
    experts, d, hidden = len(COUNTS), 6, 7
    f64 = {"dtype": torch.float64, "requires_grad": True}
    x = torch.randn(sum(COUNTS), d, **f64)
    w1, w2 = torch.randn(experts, hidden, d, **f64), torch.randn(experts, d, hidden, **f64)
    b1, b2 = (torch.randn(experts, hidden, **f64), torch.randn(experts, d, **f64)) if with_bias else (None, None)
    w_up = torch.randn(experts, hidden, d, **f64) if gated else None
    b_up = torch.randn(experts, hidden, **f64) if gated and with_bias else None
    leaves = {name: t for name, t in dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2, w_up=w_up, b_up=b_up).items()
              if t is not None}
    upstream = torch.randn(sum(COUNTS), d, dtype=torch.float64)

    got = grouped_mlp(x, COUNTS, activation, w1, b1, w2, b2, w_up, b_up)
    got_grads = torch.autograd.grad((got * upstream).sum(), list(leaves.values()))
    expected = per_expert_reference(x, COUNTS, activation, w1, b1, w2, b2, w_up, b_up)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), list(leaves.values()), allow_unused=True)

    torch.testing.assert_close(got, expected)
    for name, got_grad, expected_grad in zip(leaves, got_grads, expected_grads):
        if expected_grad is None:  # the empty expert's slice only: the reference leaves it unused
            expected_grad = torch.zeros_like(got_grad)
        torch.testing.assert_close(got_grad, expected_grad, msg=name)
        if name != "x":
            assert torch.count_nonzero(got_grad[1]) == 0, f"{name}: the expert without rows must get zero gradients"


def test_only_requested_gradients_are_computed():
    x, w1, w2 = torch.randn(4, 3), torch.randn(2, 5, 3, requires_grad=True), torch.randn(2, 3, 5)
    (grad_w1,) = torch.autograd.grad(grouped_mlp(x, [1, 3], "gelu", w1, None, w2, None).sum(), [w1])
    assert grad_w1.shape == w1.shape


def test_autocast_computes_in_the_autocast_dtype_like_linear():
    x, w1, w2 = torch.randn(4, 8), torch.randn(2, 5, 8), torch.randn(2, 8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_mlp(x, [1, 3], "silu", w1, None, w2, None)
        expected = per_expert_reference(x, [1, 3], "silu", w1, None, w2, None)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


def test_counts_and_activation_are_checked():
    x, w1, w2 = torch.randn(2, 3), torch.randn(2, 4, 3), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="row counts for 1 experts"):
        grouped_mlp(x, [2], "gelu", w1, None, w2, None)
    with pytest.raises(ValueError, match="add up to 3"):
        grouped_mlp(x, [1, 2], "gelu", w1, None, w2, None)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        grouped_mlp(x, [1, 1], "tanh", w1, None, w2, None)
