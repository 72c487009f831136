"""Hash layers (Roller et al. 2021): each token id goes to a fixed expert, hash(id) mod E; no router."""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.moe.routing import Routing, token_choice_routing
from xscale.models.registry import ROUTER
from xscale.runtime import StepContext, TokenGroup

# Knuth's multiplicative hash: the high bits of id * 2654435761 mod 2^32 spread consecutive ids.
HASH_MULTIPLIER = 2654435761


def hash_expert(token_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The fixed expert of each token id (same on every run, rank and device)."""
    mixed = (token_ids.long() * HASH_MULTIPLIER) % (1 << 32)
    return (mixed >> 16) % num_experts


@ROUTER.register("hash")
class HashRouter(nn.Module):
    """Routes by token id: the ids of the tokens routed, which the model sets (:mod:`xscale.models.moe.token_ids`)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        moe = config.moe
        self.num_experts = moe.num_experts
        self.capacity_factor = moe.capacity_factor
        self.eval_capacity_factor = moe.eval_capacity_factor
        self.min_capacity = moe.min_capacity
        self.dropless = moe.dropless
        self.drop_policy = moe.drop_policy

    def forward(self, x: torch.Tensor, group: TokenGroup, context: StepContext | None = None) -> Routing:
        token_ids = None if context is None else context.token_ids
        if token_ids is None:
            raise ValueError("the hash router needs the token ids of the tokens it routes: the Transformer passes them "
                             "in its StepContext; call a bare MoE layer as layer(x, StepContext(token_ids=input_ids))")
        token_ids, tokens = token_ids.reshape(-1), x.numel() // x.shape[-1]
        if token_ids.numel() != tokens:
            raise ValueError(f"hash router: {token_ids.numel()} token ids for {tokens} tokens; set the ids of "
                             f"the sequence this layer sees (decoder layers: decoder_input_ids)")
        expert_index = hash_expert(token_ids, self.num_experts).unsqueeze(1)
        gate = torch.ones(expert_index.shape, dtype=torch.float32, device=x.device)
        factor = None if self.dropless else (self.capacity_factor if self.training else self.eval_capacity_factor)
        return token_choice_routing(
            expert_index=expert_index, gate=gate, dispatched=torch.ones_like(expert_index, dtype=torch.bool),
            num_experts=self.num_experts, capacity_factor=factor, min_capacity=self.min_capacity,
            drop_policy=self.drop_policy, group=group, prob_sum=None, log_normaliser=None, token_shape=x.shape[:-1],
        )
