"""BASE layers (Lewis et al. 2021, "BASE Layers: Simplifying Training of Large, Sparse Models", sec. 2): while
training, the tokens of a routing group are assigned to experts by a balanced linear assignment,

  maximise sum_t h_t . w_{a_t}   subject to every expert taking n / E tokens   (eq. 1),

and a token's output is h_t + sigma(h_t . w_{a_t}) f_{a_t}(h_t) (eq. 2; the block adds h_t). At test time each token
goes to its highest-scoring expert (greedy, sec. 2.3). No load-balancing loss: the assignment is balanced by
construction.

The assignment is solved with Bertsekas' auction algorithm (forward auction, Jacobi bidding) treating each expert's
c = ceil(n / E) places as similar objects (Bertsekas and Castanon 1989): an unassigned token bids for its best expert
by the gap between its best and second-best expert values plus epsilon; an expert holds its c highest bids and asks
the lowest of them. The result is within n * epsilon of the optimum, epsilon = 1e-3 / n of the scores' spread (so
the optimum wherever the best and second-best assignments differ by more than a thousandth of the spread).

Departures: the paper shuffles the tokens across workers before routing; here the routing group (the tokens of the
ep group, one microbatch) is assigned as is. Under expert parallelism every rank solves the same assignment on the gathered scores, so every
layout routes as one process. In a decoder the training assignment reads the whole group, later tokens included,
as in the paper; evaluation routes greedily.
"""

from __future__ import annotations

import math

import torch

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.moe.routers import LearnedRouter
from xscale.models.moe.routing import Routing, token_choice_routing
from xscale.models.registry import ROUTER
from xscale.runtime import StepContext, TokenGroup

FINAL_EPSILON = 1e-3  # of the scores' spread, divided by the tokens: the auction's bidding increment


def balanced_assignment(scores: torch.Tensor) -> torch.Tensor:
    """The expert of each of the n tokens (scores [n, E]) maximising the summed score with every expert taking at
    most c = ceil(n / E) tokens (n / E each when E divides n): an auction in which each expert holds its c highest
    bids and asks the lowest of them once full (0 before); within n * epsilon of the optimum."""
    tokens, experts = scores.shape
    capacity = math.ceil(tokens / experts)
    benefit = scores.double()
    spread = float(benefit.max() - benefit.min()) if tokens else 0.0
    epsilon = max(spread, 1e-12) * FINAL_EPSILON / max(tokens, 1)
    expert_of_token = torch.full((tokens,), -1, dtype=torch.long, device=scores.device)
    bid_of_token = torch.zeros(tokens, dtype=torch.float64, device=scores.device)
    prices = torch.zeros(experts, dtype=torch.float64, device=scores.device)
    everyone = torch.arange(tokens, device=scores.device)
    while True:
        bidders = everyone[expert_of_token < 0]
        if bidders.numel() == 0:
            return expert_of_token
        values = benefit[bidders] - prices
        if experts > 1:
            top = values.topk(2, dim=1)
            best, increment = top.indices[:, 0], top.values[:, 0] - top.values[:, 1] + epsilon
        else:
            best, increment = torch.zeros_like(bidders), torch.full(bidders.shape, epsilon, dtype=values.dtype)
        expert_of_token[bidders], bid_of_token[bidders] = best, prices[best] + increment
        for expert in best.unique().tolist():  # each expert keeps its c highest bids (ties: lower token index)
            holders = (expert_of_token == expert).nonzero().squeeze(1)
            if holders.numel() > capacity:
                kept = bid_of_token[holders].argsort(descending=True, stable=True)
                expert_of_token[holders[kept[capacity:]]] = -1
                holders = holders[kept[:capacity]]
            if holders.numel() == capacity:
                prices[expert] = bid_of_token[holders].min()


@ROUTER.register("base")
class BalancedAssignmentRouter(LearnedRouter):
    """BASE routing (Lewis et al. 2021): expert embeddings w_e (the router weight), balanced assignment while
    training, top-1 at test time, gate sigma(h . w_e)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        if self.top_k != 1:
            raise ConfigError(f"the base router assigns each token to 1 expert; set model.moe.top_k=1 (got {self.top_k})")

    def forward(self, x: torch.Tensor, group: TokenGroup, context: StepContext | None = None) -> Routing:
        scores = self.router_logits(x, context)  # h_t . w_e [n, E]
        if self.training:
            everyone, member_rows = group.gather(scores.detach().view(*x.shape[:-1], -1))
            assigned = balanced_assignment(everyone)
            expert_index = assigned if member_rows is None else assigned[member_rows]
        else:
            expert_index = scores.detach().argmax(dim=-1)
        at_least_fp32 = scores.to(torch.promote_types(scores.dtype, torch.float32))
        gate = torch.sigmoid(at_least_fp32.gather(1, expert_index.unsqueeze(1)))  # sigma(h_t . w_{a_t}), eq. 2
        return token_choice_routing(
            expert_index=expert_index.unsqueeze(1), gate=gate, dispatched=torch.ones_like(gate, dtype=torch.bool),
            num_experts=self.num_experts, capacity_factor=None if self.training else self.active_capacity_factor(),
            min_capacity=self.min_capacity, drop_policy=self.drop_policy, group=group, prob_sum=None,
            log_normaliser=None, token_shape=x.shape[:-1],
        )
