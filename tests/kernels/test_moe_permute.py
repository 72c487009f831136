"""MoE permute/unpermute kernels vs index-based PyTorch, forward and gradients (tokens, expert outputs, gates)."""

import pytest
import torch
from kernel_checks import assert_close

from xscale.ops.moe_permute import permute_reference, plan_permutation, unpermute_reference
from xscale_kernels.moe_permute import Permute, Unpermute

TOKENS, TOP_K, EXPERTS, WIDTH = 13, 2, 5, 37


def _routing(tokens=TOKENS, top_k=TOP_K, experts=EXPERTS):
    scores = torch.randn(tokens, experts)
    gates, expert_ids = scores.softmax(-1).topk(top_k, dim=-1)
    return expert_ids, gates


def test_plan_groups_rows_by_expert():
    expert_ids, _ = _routing()
    plan = plan_permutation(expert_ids, EXPERTS)
    sorted_ids = expert_ids.reshape(-1)[plan.pair_of]
    assert torch.equal(sorted_ids, sorted_ids.sort().values)
    assert torch.equal(plan.tokens_per_expert, torch.bincount(expert_ids.reshape(-1), minlength=EXPERTS))
    assert torch.equal(plan.token_of[plan.position], torch.arange(TOKENS)[:, None].expand(TOKENS, TOP_K))


@pytest.mark.parametrize(("tokens", "top_k", "experts", "width"), [(13, 2, 5, 37), (9, 1, 12, 1031)],
                         ids=["top2-odd-width", "top1-wider-than-a-block"])
def test_matches_reference(dtype, tokens, top_k, experts, width):
    """width 1031 walks two column blocks of 1024 (the second partial); 9 tokens on 12 experts leave 3 or more empty."""
    expert_ids, gates = _routing(tokens, top_k, experts)
    plan = plan_permutation(expert_ids, experts)
    tokens = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
    gates = gates.requires_grad_()
    expert_scale = torch.randn(plan.token_of.numel(), 1, dtype=dtype)  # stands in for the experts
    grad_out = torch.randn(tokens.shape, dtype=dtype)

    def run(permute, unpermute):
        permuted = permute(tokens)
        out = unpermute(permuted * expert_scale)
        return (permuted, out, *torch.autograd.grad(out, [tokens, gates], grad_out))

    fused = run(lambda x: Permute.apply(x, plan.token_of, plan.position),
                lambda y: Unpermute.apply(y, plan.position, plan.token_of, plan.pair_of, gates))
    want = run(lambda x: permute_reference(x, plan), lambda y: unpermute_reference(y, plan, gates))
    assert torch.equal(fused[0], want[0]), "permute is a pure gather"
    for got, expected, name in zip(fused[1:], want[1:], ["output", "grad tokens", "grad gates"]):
        assert got.dtype == expected.dtype, name
        assert_close(got, expected, dtype, name)


def test_gates_without_gradient(dtype):
    """Fixed gates (no requires_grad): the expert-output gradient alone, the gate-gradient kernel skipped."""
    expert_ids, gates = _routing()
    plan = plan_permutation(expert_ids, EXPERTS)
    expert_out = torch.randn(TOKENS * TOP_K, WIDTH, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(TOKENS, WIDTH, dtype=dtype)
    fused = Unpermute.apply(expert_out, plan.position, plan.token_of, plan.pair_of, gates)
    want = unpermute_reference(expert_out, plan, gates)
    assert_close(fused, want, dtype, "output")
    assert_close(torch.autograd.grad(fused, expert_out, grad_out)[0],
                 torch.autograd.grad(want, expert_out, grad_out)[0], dtype, "grad expert outputs")
