"""BASE layers (Lewis et al. 2021, "BASE Layers: Simplifying Training of Large, Sparse Models", sec. 2): while
training, the tokens of a routing group are assigned to experts by a balanced linear assignment,

  maximise sum_t h_t . w_{a_t}   subject to every expert taking n / E tokens   (eq. 1),

and a token's output is h_t + sigma(h_t . w_{a_t}) f_{a_t}(h_t) (eq. 2; the block adds h_t). At test time each token
goes to its highest-scoring expert (greedy, sec. 2.3). No load-balancing loss: the assignment is balanced by
construction.

The assignment is solved exactly, as the transportation problem it is (n tokens of supply 1, E experts of capacity
c = ceil(n / E)), by successive shortest augmenting paths over the E experts (:func:`balanced_assignment`):
O(n^2 E + n E^3) work (64 tokens, 4 experts: ~6 ms; 2048 tokens, 8 experts: ~1 s on one CPU core), no tolerance,
the same on every rank.

Departures: the paper uses an auction algorithm (an auction without epsilon scaling needs a number of rounds that
grows with the scores' spread over epsilon; a pipeline-parallel parity run with one here did not finish in 10
minutes); the paper shuffles the tokens across workers before routing, here the routing group (the tokens of the ep
group, one microbatch) is assigned as is. Under expert parallelism every rank solves the same assignment on the
gathered scores, so every layout routes as one process. In a decoder the training assignment reads the whole group,
later tokens included, as in the paper; evaluation routes greedily.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.moe.routers import LearnedRouter
from xscale.models.moe.routing import Routing, token_choice_routing
from xscale.models.registry import ROUTER
from xscale.runtime import StepContext, TokenGroup


def balanced_assignment(scores: torch.Tensor) -> torch.Tensor:
    """The expert of each of the n tokens (scores [n, E]) maximising the summed score with every expert taking at
    most c = ceil(n / E) tokens (n / E each when E divides n): exact, by successive shortest augmenting paths.

    Tokens enter one at a time; the assignment of the tokens so far stays optimal. A new token t takes expert e_0
    and, if e_0 is full, one of its tokens moves on to e_1, and so on to an expert with room: the chain maximising
    s[t, e_0] + sum of the moves' gains, a longest path over the E experts (Bellman-Ford; no gaining cycle exists,
    as the assignment so far is optimal), where the move a -> b gains max over the tokens u at a of s[u, b] - s[u, a].
    """
    tokens, experts = scores.shape
    capacity = math.ceil(tokens / experts)
    benefit = scores.detach().to("cpu", torch.float64).numpy()  # thousands of tiny steps: numpy, no thread pool
    expert_of_token = np.full(tokens, -1, dtype=np.int64)
    load = np.zeros(experts, dtype=np.int64)
    for token in range(tokens):
        placed = expert_of_token[:token]
        gains = benefit[:token] - benefit[np.arange(token), placed][:, None]  # u moving from its expert to b
        move = np.full((experts, experts), -np.inf)
        np.maximum.at(move, (np.repeat(placed, experts), np.tile(np.arange(experts), token)), gains.reshape(-1))
        np.fill_diagonal(move, -np.inf)  # move[a, b]: the best token's gain a -> b
        value, came_from = benefit[token].copy(), np.full(experts, -1, dtype=np.int64)
        for _ in range(experts - 1):
            through = value[:, None] + move
            best_source = through.argmax(axis=0)
            best = through[best_source, np.arange(experts)]
            better = best > value + 1e-12 * (1 + np.abs(value))
            if not better.any():
                break
            value, came_from = np.where(better, best, value), np.where(better, best_source, came_from)
        end = int(np.where(load < capacity, value, -np.inf).argmax())
        load[end] += 1
        while came_from[end] >= 0:  # walk the chain back: the best token of each expert moves on
            source = int(came_from[end])
            at_source = np.flatnonzero(placed == source)
            expert_of_token[at_source[gains[at_source, end].argmax()]] = end
            end = source
        expert_of_token[token] = end
    return torch.from_numpy(expert_of_token).to(scores.device)


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
