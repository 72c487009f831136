"""Expert parallelism (ep=2, gloo): outputs and gradients equal one process on the same global tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from spawned import WORLD, spawn

from xscale.config.schema import ConfigError, ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.models.moe import build_moe, collect_moe_metrics
from xscale.parallel.expert import apply_expert_parallel, shard_expert_state_dict
from xscale.parallel.loss import model_loss_sum
from xscale.runtime import StepContext


def layer_config(router: str, top_k: int, ffn: str) -> ModelConfig:
    return ModelConfig(family="encoder", d_model=8, d_ff=12, ffn=ffn, moe=MoEConfig(
        num_experts=4, router=router, top_k=top_k, capacity_factor=1.0, min_capacity=0,
        second_expert_policy="all", aux_loss_coef=0.1, z_loss_coef=0.01))


def check_layer(rank: int, router: str, top_k: int, ffn: str) -> None:
    torch.manual_seed(0)
    single = build_moe(layer_config(router, top_k, ffn), 0)
    with torch.no_grad():
        for param in single.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(2 * WORLD, 6, 8)
    upstream = torch.randn(2 * WORLD, 6, 8)
    x_single = x.clone().requires_grad_()
    out_single = single(x_single)
    (out_single * upstream).sum().backward()
    assert single.metrics["dropped_fraction"] > 0, "the case must exercise token dropping"

    parallel = copy.deepcopy(single)
    parallel.zero_grad()
    place = apply_expert_parallel(parallel, dist.group.WORLD)
    rows = slice(2 * rank, 2 * rank + 2)
    x_local = x[rows].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="holds 2 of its 4 experts"):
        parallel(x_local)  # without the exchange in its context the layer has only its own experts
    out_local = parallel(x_local, context=place(StepContext()))
    (out_local * upstream[rows]).sum().backward()

    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out_local, out_single[rows], **tolerance)
    torch.testing.assert_close(x_local.grad, x_single.grad[rows], **tolerance)
    router_grad = parallel.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # replicated weight: gradients sum over the ep group
    torch.testing.assert_close(router_grad, single.router.weight.grad, **tolerance)
    experts = slice(2 * rank, 2 * rank + 2)
    for (name, shard), (_, full) in zip(parallel.experts.named_parameters(), single.experts.named_parameters()):
        assert shard.shape[0] == 2, name
        torch.testing.assert_close(shard.detach(), full.detach()[experts], **tolerance)
        torch.testing.assert_close(shard.grad, full.grad[experts], **tolerance)
    for key in ("tokens_per_expert", "dropped_fraction", "aux_loss", "z_loss"):
        torch.testing.assert_close(parallel.metrics[key], single.metrics[key], **tolerance)


def model_config() -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                       moe=MoEConfig(num_experts=4, router="switch", capacity_factor=1.0, every=1))


def check_model(rank: int) -> None:
    config = model_config()
    single = build_model(config, seed=5)
    parallel = build_model(config, seed=5)
    place = apply_expert_parallel(parallel, dist.group.WORLD)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2 * WORLD, 12), generator=generator)
    labels = torch.randint(0, 64, (2 * WORLD, 12), generator=generator)
    tokens = labels.numel()

    loss_single = model_loss_sum(single, {"input_ids": ids, "labels": labels}) / tokens
    loss_single.backward()
    rows = slice(2 * rank, 2 * rank + 2)
    loss_local = model_loss_sum(parallel, {"input_ids": ids[rows], "labels": labels[rows]}, place(StepContext())) / tokens
    loss_local.backward()
    total = loss_local.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, loss_single.detach(), rtol=1e-5, atol=1e-6)

    full = dict(single.named_parameters())
    for name, param in parallel.named_parameters():
        grad = param.grad.clone()
        if ".experts." in name:
            expected = shard_expert_state_dict({name: full[name].grad}, 4, rank, WORLD)[name]
        else:
            dist.all_reduce(grad)
            expected = full[name].grad
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert collect_moe_metrics(parallel) == pytest.approx(collect_moe_metrics(single), rel=1e-5)


def check_indivisible(rank: int) -> None:
    layer = build_moe(ModelConfig(d_model=8, d_ff=8, moe=MoEConfig(num_experts=3)), 0)
    with pytest.raises(ConfigError, match="not divisible by parallel.ep=2"):
        apply_expert_parallel(layer, dist.group.WORLD)


def check_everything(rank: int) -> None:
    check_layer(rank, "switch", 1, "gelu")
    check_layer(rank, "gshard", 2, "swiglu")
    check_model(rank)
    check_indivisible(rank)


def test_expert_parallel_matches_single_process():
    """One spawn (process start-up dominates on CPU) runs: the switch layer (gelu experts), the gshard layer
    (swiglu experts), a 2-layer MoE decoder's loss and every gradient, and the ep-divisibility refusal."""
    spawn(check_everything)


def test_shard_expert_state_dict_cuts_only_expert_weights():
    state = {"a.experts.w_in.weight": torch.arange(8).reshape(4, 2), "a.router.weight": torch.ones(4, 2)}
    shard = shard_expert_state_dict(state, 4, 1, 2)
    assert shard["a.experts.w_in.weight"].tolist() == [[4, 5], [6, 7]]
    assert shard["a.router.weight"].shape == (4, 2)
