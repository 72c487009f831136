"""Token-choice routers: Switch top-1 (Fedus et al. 2021) and GShard top-2 (Lepikhin et al. 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.dropout import uniform_draws
from xscale.models.moe.routing import Routing, router_probabilities, token_choice_routing
from xscale.models.registry import ROUTER
from xscale.ops.switch_gate import switch_gate
from xscale.runtime import StepContext, TokenGroup

SAMPLING_STREAM = 0x5EC0  # GShard's second-expert draws: another stream of the router's site than its jitter
ROUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}


class LearnedRouter(nn.Module):
    """A linear router W_r [E, d] computed in ``router_dtype`` (fp32: Switch's selective precision).

    Routers take the layer's input x [..., d] (batch first) and route its tokens flattened, row-major. Their random
    draws (jitter, sampled second experts) are functions of each token's place in the global batch
    (:func:`xscale.models.dropout.uniform_draws`, keyed by ``site``, the module's name), so every layout draws alike.
    """

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        moe = config.moe
        if moe.router_dtype not in ROUTER_DTYPES:
            raise ConfigError(f"model.moe.router_dtype='{moe.router_dtype}' is not one of {', '.join(ROUTER_DTYPES)}")
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.eval_capacity_factor = moe.eval_capacity_factor
        self.min_capacity = moe.min_capacity
        self.dropless = moe.dropless
        self.drop_policy = moe.drop_policy
        self.jitter = moe.jitter
        self.router_dtype = ROUTER_DTYPES[moe.router_dtype]
        self.site = 0  # set from the module's name (xscale.models.dropout.name_dropout_sites)
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.d_model))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.1 * config.init_std)  # small router init (Switch sec. 2.4)

    def router_input(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        """The n tokens of x [..., d] as rows [n, d] in the router dtype; multiplicative jitter, uniform in
        [1 - jitter, 1 + jitter], while training (Switch, sec. 2.4). Call with autocast off."""
        x = x.to(self.router_dtype)
        if self.training and self.jitter > 0:
            noise = uniform_draws(self.site, x.shape, x.device, context).to(x.dtype)
            x = x * (noise * (2.0 * self.jitter) + (1.0 - self.jitter))
        return x.reshape(-1, x.shape[-1])

    def router_logits(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        """Logits [n, E] of the n tokens of x [..., d], in the router dtype (:meth:`router_input`)."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(self.router_input(x, context), self.weight.to(self.router_dtype))

    def active_capacity_factor(self) -> float | None:
        if self.dropless:
            return None
        return self.capacity_factor if self.training else self.eval_capacity_factor

    def route(self, expert_index: torch.Tensor, gate: torch.Tensor, dispatched: torch.Tensor,
              prob_sum: torch.Tensor, log_normaliser: torch.Tensor, group: TokenGroup,
              token_shape: tuple[int, ...]) -> Routing:
        return token_choice_routing(
            expert_index=expert_index, gate=gate, dispatched=dispatched, num_experts=self.num_experts,
            capacity_factor=self.active_capacity_factor(), min_capacity=self.min_capacity,
            drop_policy=self.drop_policy, group=group, prob_sum=prob_sum, log_normaliser=log_normaliser,
            token_shape=token_shape,
        )


@ROUTER.register("switch")
class SwitchRouter(LearnedRouter):
    """Switch routing (Fedus et al. 2021, eq. 1-2): each token goes to argmax_i p_i(x), scaled by p_i(x)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        if self.top_k != 1:
            raise ConfigError(f"the switch router sends each token to 1 expert; set model.moe.top_k=1 "
                              f"(got {self.top_k}) or use router=gshard for top-2")

    def forward(self, x: torch.Tensor, group: TokenGroup, context: StepContext | None = None) -> Routing:
        with torch.autocast(x.device.type, enabled=False):  # one autograd node (xscale.ops.switch_gate)
            top1 = switch_gate(self.router_input(x, context), self.weight.to(self.router_dtype))
        expert_index = top1.expert.unsqueeze(1)
        routing = self.route(expert_index, top1.gate.unsqueeze(1), torch.ones_like(expert_index, dtype=torch.bool),
                             top1.prob_sum, top1.log_normaliser, group, x.shape[:-1])
        routing.input_gradient = top1.input_gradient
        return routing


@ROUTER.register("gshard")
class GShardRouter(LearnedRouter):
    """GShard top-2 gating (Lepikhin et al. 2020, Algorithm 1): gates renormalised over the top 2;
    the second expert is dispatched with probability 2 * g2 while training (``second_expert_policy=sampling``)
    or always (``all``)."""

    POLICIES = ("sampling", "all")

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        if self.top_k != 2:
            raise ConfigError(f"the gshard router sends each token to 2 experts; set model.moe.top_k=2 (got {self.top_k})")
        if config.moe.second_expert_policy not in self.POLICIES:
            raise ConfigError(f"model.moe.second_expert_policy='{config.moe.second_expert_policy}' is not one of "
                              f"{', '.join(self.POLICIES)}")
        self.second_expert_policy = config.moe.second_expert_policy

    def forward(self, x: torch.Tensor, group: TokenGroup, context: StepContext | None = None) -> Routing:
        probs, log_normaliser = router_probabilities(self.router_logits(x, context))
        top_probs, expert_index = probs.topk(2, dim=-1)
        gate = top_probs / top_probs.sum(dim=-1, keepdim=True)
        dispatched = torch.ones_like(expert_index, dtype=torch.bool)
        if self.second_expert_policy == "sampling" and self.training:
            draws = uniform_draws(self.site ^ SAMPLING_STREAM, x.shape[:-1], x.device, context).reshape(-1)
            dispatched[:, 1] = draws < 2.0 * gate[:, 1].detach()
        return self.route(expert_index, gate, dispatched, probs.sum(0), log_normaliser, group, x.shape[:-1])
