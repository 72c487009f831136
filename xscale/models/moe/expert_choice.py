"""Expert-choice routing (Zhou et al. 2022): each expert takes its top-c tokens, c = capacity_factor * n / E.

Every expert gets exactly c tokens (perfect balance, no load-balancing loss); a token may get several
experts or none. Choosing among all tokens of the sequence uses future tokens, so it is refused in
causal decoders.
"""

from __future__ import annotations

import math

import torch

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.moe.routers import LearnedRouter
from xscale.models.moe.routing import Routing, local_rows, router_probabilities, router_z_loss
from xscale.models.registry import ROUTER
from xscale.runtime import StepContext, TokenGroup


@ROUTER.register("expert_choice")
class ExpertChoiceRouter(LearnedRouter):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        in_decoder = config.family == "decoder" or (config.family == "encoder_decoder" and layer_index >= config.n_layers)
        if in_decoder:
            raise ConfigError(
                f"router=expert_choice in layer {layer_index} of a causal decoder would let a token's routing depend "
                "on later tokens (it leaks the future); use router=switch or gshard, or an encoder"
            )
        if self.dropless:
            raise ConfigError("router=expert_choice has a fixed capacity per expert; set model.moe.dropless=false")

    def forward(self, x: torch.Tensor, group: TokenGroup, context: StepContext | None = None) -> Routing:
        scores, log_normaliser = router_probabilities(self.router_logits(x, context))  # affinities S = softmax(X W)
        everyone, member_rows = group.gather(scores.detach().view(*x.shape[:-1], -1))
        group_tokens = everyone.shape[0]
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = min(max(math.ceil(group_tokens * factor / self.num_experts), self.min_capacity), group_tokens)
        chosen = everyone.topk(capacity, dim=0).indices.t()  # [E, c]: each expert's tokens (I = TopK(S^T, c))
        expert_flat = torch.arange(self.num_experts, device=x.device).repeat_interleave(capacity)
        token_flat = chosen.reshape(-1)
        local_token = local_rows(token_flat, member_rows, group_tokens)
        mine = local_token >= 0
        token_index = local_token[mine]
        expert_index = expert_flat[mine]
        covered = torch.zeros(group_tokens, dtype=torch.bool, device=x.device)
        covered[token_flat] = True
        return Routing(
            token_index=token_index, expert_index=expert_index, gate=scores[token_index, expert_index],
            local_tokens_per_expert=torch.bincount(expert_index, minlength=self.num_experts),
            tokens_per_expert=torch.full((self.num_experts,), capacity, device=x.device),
            dropped_fraction=1.0 - covered.float().mean(),
            aux_loss=scores.new_zeros(()), z_loss=router_z_loss(log_normaliser, group_tokens),
        )
