"""Router semantics on hand-computed cases (GShard / Switch / ST-MoE / expert choice / hash)."""

from __future__ import annotations

import math

import pytest
import torch

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models.dropout import uniform_draws
from xscale.models.moe.expert_choice import ExpertChoiceRouter
from xscale.models.moe.hash_router import HASH_MULTIPLIER, HashRouter, hash_expert
from xscale.models.moe.routers import GShardRouter, SwitchRouter
from xscale.models.moe.routing import LocalTokens, expert_capacity, token_choice_routing
from xscale.runtime import StepContext


def route(experts, gates, *, capacity_factor, drop_policy="position", num_experts=2, dispatched=None):
    expert_index = torch.tensor(experts).reshape(len(experts), -1)
    gate = torch.tensor(gates, dtype=torch.float32).reshape(expert_index.shape)
    if dispatched is None:
        dispatched = torch.ones_like(expert_index, dtype=torch.bool)
    return token_choice_routing(expert_index=expert_index, gate=gate, dispatched=dispatched,
                                num_experts=num_experts, capacity_factor=capacity_factor, min_capacity=0,
                                drop_policy=drop_policy, group=LocalTokens(), prob_sum=None, log_normaliser=None)


def kept_pairs(routing):
    return sorted(zip(routing.token_index.tolist(), routing.expert_index.tolist()))


def test_capacity_formula():
    assert expert_capacity(6, 2, 1, 1.0, 0) == 3
    assert expert_capacity(10, 4, 2, 1.25, 0) == math.ceil(10 * 2 / 4 * 1.25)  # 7
    assert expert_capacity(4, 8, 1, 1.0, 4) == 4  # min_capacity wins


def test_position_policy_drops_the_latest_token_of_a_full_expert():
    # capacity = ceil(6 / 2 * 1.0) = 3; expert 0 is asked by tokens 0, 1, 2, 4 -> token 4 overflows.
    routing = route([0, 0, 0, 1, 0, 1], [0.6, 0.9, 0.7, 0.5, 0.8, 0.5], capacity_factor=1.0)
    assert kept_pairs(routing) == [(0, 0), (1, 0), (2, 0), (3, 1), (5, 1)]
    assert routing.tokens_per_expert.tolist() == [3, 2]
    assert routing.dropped_fraction.item() == pytest.approx(1 / 6)
    assert routing.expert_index.tolist() == sorted(routing.expert_index.tolist())


def test_probs_policy_drops_the_lowest_gate():
    # Same requests; expert 0 keeps its 3 highest gates (0.9, 0.8, 0.7): token 0 (0.6) overflows.
    routing = route([0, 0, 0, 1, 0, 1], [0.6, 0.9, 0.7, 0.5, 0.8, 0.5], capacity_factor=1.0, drop_policy="probs")
    assert kept_pairs(routing) == [(1, 0), (2, 0), (3, 1), (4, 0), (5, 1)]


def test_first_choices_take_capacity_before_second_choices():
    # 4 tokens, top-2, 2 experts, capacity = ceil(4 * 2 / 2 * 0.5) = 2.
    # Expert 0: first choice of tokens 1, 3 -> both kept; second choice of tokens 0, 2 -> dropped.
    experts = [[1, 0], [0, 1], [1, 0], [0, 1]]
    routing = route(experts, [[0.6, 0.4]] * 4, capacity_factor=0.5)
    assert kept_pairs(routing) == [(0, 1), (1, 0), (2, 1), (3, 0)]
    assert routing.dropped_fraction.item() == pytest.approx(0.5)


def test_undispatched_second_choice_uses_no_capacity():
    experts = [[0, 1], [1, 0]]
    dispatched = torch.tensor([[True, False], [True, True]])
    routing = route(experts, [[0.7, 0.3], [0.6, 0.4]], capacity_factor=10.0, dispatched=dispatched)
    assert kept_pairs(routing) == [(0, 0), (1, 0), (1, 1)]


def test_dropless_drops_nothing():
    routing = route([0] * 7 + [1], [0.5] * 8, capacity_factor=None)
    assert routing.dropped_fraction.item() == 0.0
    assert routing.tokens_per_expert.tolist() == [7, 1]


def config(**moe) -> ModelConfig:
    return ModelConfig(family="encoder", d_model=2, ffn="relu", d_ff=4, moe=MoEConfig(**moe))


def test_switch_aux_loss_and_z_loss_by_hand():
    router = SwitchRouter(config(num_experts=2, top_k=1, min_capacity=0, capacity_factor=2.0), 0)
    # x = one-hot rows and W = I make the logits equal x.
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    logits = torch.tensor([[math.log(7), math.log(3)], [math.log(6), math.log(4)],
                           [math.log(2), math.log(8)], [math.log(9), math.log(1)]])
    routing = router(logits, LocalTokens())
    # probs [[.7,.3],[.6,.4],[.2,.8],[.9,.1]]: f = [3/4, 1/4], P = [.6, .4]; aux = 2 * (.45 + .1) = 1.1
    assert routing.aux_loss.item() == pytest.approx(1.1, rel=1e-6)
    # logsumexp = log 10 for every token
    assert routing.z_loss.item() == pytest.approx(math.log(10) ** 2, rel=1e-6)
    gate_of_token = dict(zip(routing.token_index.tolist(), routing.gate.tolist()))
    assert [gate_of_token[t] for t in range(4)] == pytest.approx([0.7, 0.6, 0.8, 0.9])


def test_gshard_gates_renormalised_and_second_expert_sampled_by_weight():
    router = GShardRouter(config(num_experts=3, top_k=2, capacity_factor=4.0, second_expert_policy="sampling"), 0)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    x = torch.tensor([[math.log(6), math.log(2)]]).repeat(4000, 1)  # probs 6/9, 2/9, 1/9
    router.eval()
    routing = router(x, LocalTokens())
    assert sorted(set(routing.gate.tolist())) == pytest.approx([0.25, 0.75])  # 2/(6+2), 6/(6+2)
    router.train()
    routing = router(x, LocalTokens())
    second_kept = (routing.expert_index == 1).float().sum().item() / 4000
    assert second_kept == pytest.approx(2 * 0.25, abs=0.04)  # dispatched with probability 2 * g2


def test_jitter_scales_the_router_input_by_uniform_noise_while_training():
    router = SwitchRouter(config(num_experts=4, jitter=0.2), 0)
    router.site = 123
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(2, 5, 2)
    position = StepContext(seed=4, step=2, first_sample=6)
    logits = router.router_logits(x, position)
    noise = uniform_draws(123, x.shape, x.device, position)
    expected = (x * (0.8 + 0.4 * noise)).reshape(-1, 2) @ router.weight.t()
    torch.testing.assert_close(logits, expected)
    assert not torch.allclose(logits, x.reshape(-1, 2) @ router.weight.t())
    router.eval()
    torch.testing.assert_close(router.router_logits(x, position), x.reshape(-1, 2) @ router.weight.t())


def test_expert_choice_is_perfectly_balanced():
    router = ExpertChoiceRouter(config(num_experts=4, router="expert_choice", capacity_factor=1.0, min_capacity=0), 0)
    with torch.no_grad():
        router.weight.normal_()
    routing = router(torch.randn(24, 2) * 5, LocalTokens())
    assert routing.local_tokens_per_expert.tolist() == [6, 6, 6, 6]
    assert routing.aux_loss.item() == 0.0
    for expert in range(4):  # no expert takes a token twice
        tokens = routing.token_index[routing.expert_index == expert]
        assert tokens.unique().numel() == 6


def test_hash_routing_is_a_fixed_function_of_the_token_id():
    ids = torch.tensor([0, 1, 2, 12345, 1, 0])
    expected = [((i * HASH_MULTIPLIER) % 2**32 >> 16) % 8 for i in ids.tolist()]
    assert hash_expert(ids, 8).tolist() == expected
    router = HashRouter(config(num_experts=8, router="hash", dropless=True), 0)
    routing = router(torch.zeros(6, 2), LocalTokens(), StepContext(token_ids=ids))
    got = dict(zip(routing.token_index.tolist(), routing.expert_index.tolist()))
    assert [got[t] for t in range(6)] == expected
    assert hash_expert(torch.arange(1000), 8).bincount().min() > 80  # spreads ids over all experts
    with pytest.raises(ValueError, match="token ids"):
        router(torch.zeros(6, 2), LocalTokens())
