"""The grouped-GEMM expert path (``torch._grouped_mm``) vs the per-expert path, forward and gradients.

torch runs ``_grouped_mm`` on CPU in fp32 too, so the arithmetic is checked here; tests/gpu runs it on CUDA in bf16,
where the MoE layer takes it.
"""

import pytest
import torch

from xscale.ops.grouped_mlp import ExpertWeights, grouped_mlp
from xscale.ops.grouped_mm_mlp import grouped_mm_applies, grouped_mm_mlp, grouped_mm_token_experts
from xscale.ops.token_experts import token_experts

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch < 2.8 has no _grouped_mm")
COUNTS = [3, 0, 6, 4]  # an expert without rows included
D, HIDDEN = 16, 24


def _weights(gated: bool, bias: bool) -> ExpertWeights:
    def tensor(*shape):
        return (0.2 * torch.randn(*shape)).requires_grad_()

    experts = len(COUNTS)
    return ExpertWeights(tensor(experts, HIDDEN, D), tensor(experts, HIDDEN) if bias else None,
                         tensor(experts, HIDDEN, D) if gated else None,
                         tensor(experts, HIDDEN) if gated and bias else None,
                         tensor(experts, D, HIDDEN), tensor(experts, D) if bias else None,
                         "silu" if gated else "gelu")


def _leaves(x, weights):
    return [t for t in (x, weights.w1, weights.b1, weights.w_up, weights.b_up, weights.w2, weights.b2)
            if t is not None]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "mlp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_grouped_mm_matches_the_per_expert_path(gated, bias):
    torch.manual_seed(0)
    weights = _weights(gated, bias)
    x = torch.randn(sum(COUNTS), D, requires_grad=True)
    grad_y = torch.randn(sum(COUNTS), D)
    got = grouped_mm_mlp(x, COUNTS, weights)
    want = grouped_mlp(x, COUNTS, weights.activation, weights.w1, weights.b1, weights.w2, weights.b2, weights.w_up,
                       weights.b_up)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got_grads = torch.autograd.grad((got * grad_y).sum(), _leaves(x, weights))
    want_grads = torch.autograd.grad((want * grad_y).sum(), _leaves(x, weights))
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_token_experts_through_grouped_mm_match():
    torch.manual_seed(1)
    weights = _weights(gated=True, bias=False)
    tokens = torch.randn(20, D, requires_grad=True)
    token_index = torch.randperm(20)[:sum(COUNTS)]
    gate = torch.rand(sum(COUNTS), requires_grad=True)
    got = grouped_mm_token_experts(tokens, token_index, gate, COUNTS, weights)
    want = token_experts(tokens, token_index, gate, COUNTS, weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    leaves = [tokens, gate, weights.w1, weights.w_up, weights.w2]
    for got_grad, want_grad in zip(torch.autograd.grad(got.square().sum(), leaves),
                                   torch.autograd.grad(want.square().sum(), leaves)):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_the_layer_takes_grouped_mm_only_on_cuda_in_bf16():
    weights = _weights(gated=True, bias=False)
    assert not grouped_mm_applies(torch.randn(4, D), weights)  # CPU: the threaded per-expert path
    assert not grouped_mm_applies(torch.randn(4, D, dtype=torch.bfloat16), weights)
