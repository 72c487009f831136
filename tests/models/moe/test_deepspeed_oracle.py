"""External oracle: our Switch top-1 layer equals DeepSpeed's ``deepspeed.moe.layer.MoE`` (k=1, token dropping),
and our GShard top-2 layer (both choices dispatched) equals it with k=2 (``top2_2nd_expert_sampling=False``).

DeepSpeed's top-1 gate: gate = softmax(x W_g^T) of the argmax expert, capacity = max(ceil(S / E * cf),
min_capacity), dropping by ``torch.topk`` over the 0/1 expert mask (``use_rts=False``). ``topk`` breaks ties
in no documented order, so during DeepSpeed's forward we make it stable (ties by token order), which is
the first-come-first-served rule of GShard/Switch and of ``drop_policy=position``.

Top-2 is compared where nothing overflows (capacity 2 x cf x S / E with cf = 2 holds every token): DeepSpeed
renormalises the two gates over the choices that survived capacity (a token whose second choice overflowed
keeps gate 1 on its first), while GShard's Algorithm 1, and xscale, normalise g1 and g2 before capacity.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models.moe import build_moe

deepspeed_layer = pytest.importorskip("deepspeed.moe.layer", reason="deepspeed is not installed")
dist = torch.distributed

D_MODEL, HIDDEN, EXPERTS, CAPACITY_FACTOR = 8, 16, 4, 1.0


class GeluExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Linear(D_MODEL, HIDDEN, bias=True)
        self.w_out = nn.Linear(HIDDEN, D_MODEL, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


_topk = torch.topk


def stable_topk(input, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


@contextlib.contextmanager
def single_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("top_k,capacity_factor", [(1, CAPACITY_FACTOR), (2, 2.0)], ids=["switch", "gshard_top2"])
def test_layer_matches_deepspeed_moe(top_k, capacity_factor):
    config = ModelConfig(d_model=D_MODEL, d_ff=HIDDEN, ffn="gelu", bias=True, moe=MoEConfig(
        num_experts=EXPERTS, router="switch" if top_k == 1 else "gshard", top_k=top_k, second_expert_policy="all",
        capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=0,
        drop_policy="position", aux_loss_coef=0.0, z_loss_coef=0.0))
    ours = build_moe(config, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(3, 10, D_MODEL)
    upstream = torch.randn(3, 10, D_MODEL)

    with single_process_group():
        theirs = deepspeed_layer.MoE(D_MODEL, GeluExpert(), num_experts=EXPERTS, ep_size=1, k=top_k,
                                     capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                                     min_capacity=0, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
        with torch.no_grad():
            theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
            for e, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
                expert.w_in.weight.copy_(ours.experts.w_in.weight[e])
                expert.w_in.bias.copy_(ours.experts.w_in.bias[e])
                expert.w_out.weight.copy_(ours.experts.w_out.weight[e])
                expert.w_out.bias.copy_(ours.experts.w_out.bias[e])
        x_theirs = x.clone().requires_grad_()
        with mock.patch("torch.topk", stable_topk):
            out_theirs, aux_theirs, _ = theirs(x_theirs)
        (out_theirs * upstream).sum().backward()

    x_ours = x.clone().requires_grad_()
    out_ours = ours(x_ours)
    (out_ours * upstream).sum().backward()

    if top_k == 1:
        assert ours.metrics["dropped_fraction"].item() > 0.05, "the case must exercise token dropping"
    else:
        assert ours.metrics["dropped_fraction"].item() == 0.0
        assert int(ours.metrics["tokens_per_expert"].sum()) == 2 * 30, "every token reaches two experts"
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.metrics["aux_loss"], aux_theirs.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.router.weight.grad, theirs.deepspeed_moe.gate.wg.weight.grad, rtol=1e-5, atol=1e-6)
    for e, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
        torch.testing.assert_close(ours.experts.w_in.weight.grad[e], expert.w_in.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.experts.w_out.bias.grad[e], expert.w_out.bias.grad, rtol=1e-5, atol=1e-6)
