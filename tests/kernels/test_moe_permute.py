"""MoE permute/unpermute kernels vs index-based PyTorch, forward and gradients (tokens, expert outputs, gates)."""

import torch
from conftest import assert_close

from xscale.ops.moe_permute import permute_reference, plan_permutation, unpermute_reference
from xscale_kernels.moe_permute import Permute, Unpermute

TOKENS, TOP_K, EXPERTS, WIDTH = 13, 2, 5, 37


def _routing():
    scores = torch.randn(TOKENS, EXPERTS)
    gates, expert_ids = scores.softmax(-1).topk(TOP_K, dim=-1)
    return expert_ids, gates


def test_plan_groups_rows_by_expert():
    expert_ids, _ = _routing()
    plan = plan_permutation(expert_ids, EXPERTS)
    sorted_ids = expert_ids.reshape(-1)[plan.pair_of]
    assert torch.equal(sorted_ids, sorted_ids.sort().values)
    assert torch.equal(plan.tokens_per_expert, torch.bincount(expert_ids.reshape(-1), minlength=EXPERTS))
    assert torch.equal(plan.token_of[plan.position], torch.arange(TOKENS)[:, None].expand(TOKENS, TOP_K))


def test_matches_reference(dtype):
    expert_ids, gates = _routing()
    plan = plan_permutation(expert_ids, EXPERTS)
    tokens = torch.randn(TOKENS, WIDTH, dtype=dtype, requires_grad=True)
    gates = gates.requires_grad_()
    expert_scale = torch.randn(TOKENS * TOP_K, 1, dtype=dtype)  # stands in for the experts
    grad_out = torch.randn(TOKENS, WIDTH, dtype=dtype)

    def run(permute, unpermute):
        permuted = permute(tokens)
        out = unpermute(permuted * expert_scale)
        return (permuted, out, *torch.autograd.grad(out, [tokens, gates], grad_out))

    fused = run(lambda x: Permute.apply(x, plan.token_of, plan.position),
                lambda y: Unpermute.apply(y, plan.position, plan.token_of, plan.pair_of, gates))
    want = run(lambda x: permute_reference(x, plan), lambda y: unpermute_reference(y, plan, gates))
    assert torch.equal(fused[0], want[0]), "permute is a pure gather"
    for got, expected, name in zip(fused[1:], want[1:], ["output", "grad tokens", "grad gates"]):
        assert_close(got, expected, dtype, name)
