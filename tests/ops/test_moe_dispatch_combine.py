"""combine_by_gate: the gate-weighted sum of expert outputs back onto tokens, forward and backward."""

import pytest
import torch

from xscale.ops.moe_permute import assignment_of_token, combine_by_gate, gather_tokens


def test_matches_the_weighted_index_add_with_repeated_and_missing_tokens():
    torch.manual_seed(0)
    token_index = torch.tensor([4, 0, 2, 0, 4, 1])  # tokens 0 and 4 twice (top-2), token 3 dropped entirely
    rows = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(5, 5, dtype=torch.float64)

    got = combine_by_gate(rows, gate, token_index, 5)
    expected = torch.zeros(5, 5, dtype=torch.float64).index_add(0, token_index, rows * gate[:, None])
    torch.testing.assert_close(got, expected)
    assert torch.count_nonzero(got[3]) == 0
    got_grads = torch.autograd.grad((got * upstream).sum(), [rows, gate])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [rows, gate])
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad)


def test_output_dtype_and_gate_dtype_are_kept():
    rows = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    gate = torch.rand(3, requires_grad=True)  # the router's float32 gate
    out = combine_by_gate(rows, gate, torch.tensor([0, 1, 1]), 2, torch.float32)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert rows.grad.dtype == torch.bfloat16 and gate.grad.dtype == torch.float32


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one entry per assignment"):
        combine_by_gate(torch.randn(3, 4), torch.rand(2), torch.tensor([0, 1, 2]), 3)


def test_one_assignment_per_token_gathers_give_the_scatter_results():
    """Top-1 with drops: the gather forms of dispatch's backward and of combine equal the scatter forms."""
    torch.manual_seed(0)
    token_index = torch.tensor([3, 0, 5, 1])  # tokens 2 and 4 dropped
    assignment = assignment_of_token(token_index, 6)
    assert assignment.tolist() == [1, 3, 4, 0, 4, 2]
    tokens = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(6, 5, dtype=torch.float64)
    results = []
    for one_per_token in (None, assignment):
        rows = gather_tokens(tokens, token_index, one_per_token)
        out = combine_by_gate(rows * 2.0, gate, token_index, 6, assignment=one_per_token)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), [tokens, gate])))
    for scatter, gather in zip(*results):
        torch.testing.assert_close(gather, scatter)
    out, grad_tokens, _ = results[1]
    assert torch.count_nonzero(out[[2, 4]]) == 0 and torch.count_nonzero(grad_tokens[[2, 4]]) == 0
    expected = torch.zeros(6, 5, dtype=torch.float64).index_add(0, token_index, 2.0 * tokens[token_index] * gate[:, None])
    torch.testing.assert_close(results[0][0], expected)


def test_nothing_kept_gives_zeros():
    tokens = torch.randn(3, 2, requires_grad=True)
    empty = torch.empty(0, dtype=torch.long)
    assignment = assignment_of_token(empty, 3)
    rows = gather_tokens(tokens, empty, assignment)
    out = combine_by_gate(rows, torch.empty(0), empty, 3, assignment=assignment)
    assert torch.equal(out, torch.zeros(3, 2))
    out.sum().backward()
    assert torch.equal(tokens.grad, torch.zeros(3, 2))


@pytest.mark.parametrize("bad", [-1, 4])
def test_expert_ids_out_of_range_are_refused_with_the_range(bad):
    from xscale.ops.moe_permute import plan_permutation

    ids = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(ValueError, match=rf"must lie in \[0, 4\); got \[{min(bad, 0)}, {max(bad, 2)}\]"):
        plan_permutation(ids, 4)
    assert plan_permutation(torch.tensor([[0, 3], [2, 1]]), 4).tokens_per_expert.tolist() == [1, 1, 1, 1]
