"""grouped_linear: outputs and gradients equal one F.linear per expert on its rows (empty experts included)."""

import pytest
import torch
import torch.nn.functional as F

from xscale.ops.grouped_linear import grouped_linear


def per_expert_reference(x, weight, bias, counts):
    chunks = x.split(counts)
    return torch.cat([F.linear(chunk, weight[e], None if bias is None else bias[e]) for e, chunk in enumerate(chunks)])


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_one_linear_per_expert_forward_and_backward(with_bias):
    torch.manual_seed(0)
    counts = [3, 0, 5, 1]  # expert 1 receives nothing: its gradients must be zero, not garbage
    x = torch.randn(sum(counts), 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 7, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, 7, dtype=torch.float64, requires_grad=True) if with_bias else None
    upstream = torch.randn(sum(counts), 7, dtype=torch.float64)
    leaves = [x, weight] + ([bias] if with_bias else [])

    got = grouped_linear(x, weight, bias, counts)
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    expected = per_expert_reference(x, weight, bias, counts)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves, allow_unused=True)

    torch.testing.assert_close(got, expected)
    for name, got_grad, expected_grad in zip(["x", "weight", "bias"], got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, msg=name)
    assert torch.equal(got_grads[1][1], torch.zeros(7, 6, dtype=torch.float64))


def test_autocast_computes_in_the_autocast_dtype_like_linear():
    x, weight = torch.randn(4, 8), torch.randn(2, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_linear(x, weight, None, [1, 3])
        expected = per_expert_reference(x, weight, None, [1, 3])
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


def test_counts_must_match_the_weight_and_the_rows():
    with pytest.raises(ValueError, match="row counts for 1 experts"):
        grouped_linear(torch.randn(2, 3), torch.randn(2, 4, 3), None, [2])
    with pytest.raises(ValueError, match="add up to 3"):
        grouped_linear(torch.randn(2, 3), torch.randn(2, 4, 3), None, [1, 2])
