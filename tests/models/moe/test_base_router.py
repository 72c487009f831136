"""BASE layers (Lewis et al. 2021): the balanced assignment (successive shortest paths) against every balanced
assignment enumerated, the router's gates and gradients against a token-by-token loop, greedy routing at test time, the top_k refusal."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from xscale.config.schema import ConfigError, ModelConfig, MoEConfig
from xscale.models.moe.base_router import BalancedAssignmentRouter, balanced_assignment
from xscale.models.moe.routing import LocalTokens


def best_balanced_total(scores: torch.Tensor) -> float:
    """The largest summed score over every assignment giving each expert at most ceil(n / E) tokens (a loop)."""
    tokens, experts = scores.shape
    capacity = math.ceil(tokens / experts)
    best = -math.inf
    for assignment in itertools.product(range(experts), repeat=tokens):
        if max(assignment.count(e) for e in range(experts)) <= capacity:
            best = max(best, sum(float(scores[t, e]) for t, e in enumerate(assignment)))
    return best


@pytest.mark.parametrize("tokens,experts,seed", [(6, 3, 0), (8, 2, 1), (7, 3, 2), (8, 4, 3)])
def test_finds_the_best_balanced_assignment(tokens: int, experts: int, seed: int) -> None:
    scores = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assigned = balanced_assignment(scores)
    assert torch.bincount(assigned, minlength=experts).max() <= math.ceil(tokens / experts)
    assert float(scores.gather(1, assigned[:, None]).sum()) == pytest.approx(best_balanced_total(scores), abs=1e-9)


def test_balances_tokens_that_all_prefer_one_expert() -> None:
    scores = torch.tensor([[5.0, 0.0], [4.0, 0.0], [3.0, 0.0], [2.0, 0.0]])
    assert balanced_assignment(scores).tolist() == [0, 0, 1, 1]


def router(**moe) -> BalancedAssignmentRouter:
    config = ModelConfig(family="decoder", d_model=6, d_ff=8, moe=MoEConfig(num_experts=4, router="base",
                                                                            router_dtype="float64", **moe))
    layer = BalancedAssignmentRouter(config, 0).double()
    torch.nn.init.normal_(layer.weight)
    return layer


def test_gates_and_gradients_match_a_loop() -> None:
    layer = router()
    x = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    routing = layer(x, LocalTokens())
    scores = (x.reshape(-1, 6) @ layer.weight.t()).detach()
    expert = balanced_assignment(scores)
    assert routing.tokens_per_expert.tolist() == [3, 3, 3, 3]
    assert sorted(zip(routing.token_index.tolist(), routing.expert_index.tolist())) == list(enumerate(expert.tolist()))
    flat = x.reshape(-1, 6)
    want = torch.stack([torch.sigmoid(flat[t] @ layer.weight[expert[t]]) for t in routing.token_index.tolist()])
    torch.testing.assert_close(routing.gate, want)
    grad = torch.randn_like(want)
    for got, ref in zip(torch.autograd.grad(routing.gate, (x, layer.weight), grad),
                        torch.autograd.grad(want, (x, layer.weight), grad)):
        torch.testing.assert_close(got, ref)
    assert float(routing.aux_loss) == 0.0


def test_test_time_routing_is_greedy() -> None:
    layer = router(dropless=True).eval()
    x = torch.randn(12, 6, dtype=torch.float64)
    routing = layer(x, LocalTokens())
    best = (x @ layer.weight.t()).argmax(-1)
    assert sorted(zip(routing.token_index.tolist(), routing.expert_index.tolist())) == list(enumerate(best.tolist()))


def test_refuses_top_2() -> None:
    with pytest.raises(ConfigError, match="set model.moe.top_k=1"):
        router(top_k=2)
