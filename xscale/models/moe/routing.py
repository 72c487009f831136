"""What every router shares: the routing group, expert capacity, the capacity cut and the auxiliary losses.

Capacity and token dropping follow GShard (Lepikhin et al. 2020, Algorithm 1) and Switch (Fedus et al.
2021, eq. 3-4); the router z-loss is ST-MoE's (Zoph et al. 2022, eq. 5).

Routing decisions (which assignment fits in an expert's capacity, the load-balancing fractions) are
made over a *routing group* of tokens: on one device, the tokens of the forward call; under expert
parallelism, the tokens of every rank of the ep group (:mod:`xscale.parallel.expert` supplies a group
whose ``gather`` concatenates the ranks' rows). Either way the decisions, and so the outputs, are the
single-device ones on the group's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xscale.ops.shared_input_gradient import SharedInputGradient
from xscale.runtime import TokenGroup


class LocalTokens:
    """The routing group of one device: the forward call's own tokens."""

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The rows flattened to [n, c]: this device's tokens are the whole group."""
        return rows.reshape(-1, rows.shape[-1]), None

    def all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the members (detached)."""
        return value


@dataclass
class Routing:
    """The kept (token, expert, gate) assignments of this device's tokens, sorted by expert."""

    token_index: torch.Tensor  # [A] row of the token in this device's flat tokens
    expert_index: torch.Tensor  # [A] global expert id, non-decreasing
    gate: torch.Tensor  # [A] combine weight; differentiable w.r.t. the router
    local_tokens_per_expert: torch.Tensor  # [E] kept assignments of this device per expert
    tokens_per_expert: torch.Tensor  # [E] kept assignments over the routing group
    dropped_fraction: torch.Tensor  # dropped / routed assignments over the routing group
    aux_loss: torch.Tensor  # this device's share of the group's load-balancing loss (shares sum to it)
    z_loss: torch.Tensor  # this device's share of the group's router z-loss
    one_per_token: bool = False  # no token has two kept assignments (top-1): dispatch and combine can gather
    input_gradient: SharedInputGradient | None = None  # the router's, for an experts' pass reading the same rows
    # Static rows (:func:`static_rows_routing`): every assignment is a row, the ones not kept with gate 0, and
    # row_ends[e] is where expert e's rows end (the last expert's also hold the undispatched tail). None: kept only.
    row_ends: torch.Tensor | None = None


def count_by_index(index: torch.Tensor, bins: int) -> torch.Tensor:
    """How often each of 0..bins-1 occurs in ``index`` (long [bins]): ``torch.bincount`` with ``minlength=bins``
    for indices below ``bins``, without its host sync (on CUDA bincount reads the maximum to size its output)."""
    return torch.zeros(bins, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                    min_capacity: int) -> int:
    """Assignments an expert accepts: ceil(tokens * k / experts * capacity_factor), at least min_capacity."""
    return max(math.ceil(num_tokens * top_k / num_experts * capacity_factor), min_capacity)


def load_balancing_loss(prob_sum: torch.Tensor, first_choice: torch.Tensor, num_experts: int,
                        group_tokens: int) -> torch.Tensor:
    """Switch eq. 4: E * sum_e f_e * P_e; f_e from the group's first choices, P_e from this device's router
    probabilities, summed over its tokens (``prob_sum`` [E]).

    P_e = (sum of this device's probs) / group tokens, so the devices' shares add up to the group's loss and
    the gradient of each share is the single-device gradient w.r.t. that device's tokens.
    """
    fraction = count_by_index(first_choice, num_experts).to(prob_sum.dtype) / group_tokens
    return num_experts * (fraction * prob_sum).sum() / group_tokens


def router_probabilities(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits) over the experts in float32, and logsumexp(logits) [n] (the z-loss's term): one log-sum-exp
    serves both (softmax = exp(logits - logsumexp)); ATen's softmax over a last dimension of a few experts is
    several times slower than these element-wise passes."""
    log_normaliser = torch.logsumexp(logits.float(), dim=-1)
    return torch.exp(logits.float() - log_normaliser.unsqueeze(-1)), log_normaliser


def router_z_loss(log_normaliser: torch.Tensor, group_tokens: int) -> torch.Tensor:
    """ST-MoE eq. 5: mean over the group's tokens of logsumexp(logits)^2 (this device's share), from the
    logsumexp of each token's router logits (:func:`router_probabilities`)."""
    return log_normaliser.square().sum() / group_tokens


def local_rows(group_rows: torch.Tensor, member_rows: torch.Tensor | None, group_tokens: int) -> torch.Tensor:
    """This member's row of each group row in ``group_rows``, -1 where another member holds it (``member_rows``:
    :meth:`TokenGroup.gather`'s placement of this member's rows; None: every row is this member's)."""
    if member_rows is None:
        return group_rows
    local = torch.full((group_tokens,), -1, dtype=torch.long, device=group_rows.device)
    local[member_rows] = torch.arange(member_rows.numel(), device=group_rows.device)
    return local.index_select(0, group_rows)


def rank_within_expert(expert: torch.Tensor, priority: torch.Tensor | None,
                       num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order assignments by (expert, priority) and number them within their expert from 0.

    ``priority=None``: by (expert, assignment index).
    Returns (order, rank): ``order`` sorts the assignments, ``rank[i]`` is the place of assignment
    ``order[i]`` in its expert's queue. Experts >= num_experts (not dispatched) sort last.
    """
    if priority is None:  # queue order is assignment order: one stable sort by expert
        order = torch.argsort(expert, stable=True)
    else:
        by_priority = torch.argsort(priority, stable=True)
        order = by_priority[torch.argsort(expert[by_priority], stable=True)]
    counts = count_by_index(expert, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    sorted_expert = expert[order]
    rank = torch.arange(expert.numel(), device=expert.device) - starts[sorted_expert]
    return order, rank


def token_choice_routing(*, expert_index: torch.Tensor, gate: torch.Tensor, dispatched: torch.Tensor,
                         num_experts: int, capacity_factor: float | None, min_capacity: int,
                         drop_policy: str, group: TokenGroup,
                         prob_sum: torch.Tensor | None, log_normaliser: torch.Tensor | None,
                         token_shape: tuple[int, ...] | None = None) -> Routing:
    """Each token picked k experts (``expert_index`` [n, k], ``gate`` [n, k]); cut every expert at capacity.

    ``dispatched`` [n, k] marks the picks that are sent at all (GShard's sampled second expert).
    Priority in an expert's queue (GShard): all first choices before any second choice; then
    ``drop_policy="position"`` keeps tokens in order (earlier first), ``"probs"`` keeps higher gates first.
    Capacity comes from the group's token count (:func:`expert_capacity`); ``capacity_factor=None``: dropless.
    ``prob_sum`` [E] (the router probabilities summed over the n tokens) and ``log_normaliser`` [n]
    (:func:`router_probabilities`) feed the auxiliary losses (None: no router). ``token_shape``: the batch-first shape (B, T) of the n tokens (a context-parallel group places each
    rank's tokens in the sequence by it; None: flat).
    """
    n, top_k = expert_index.shape
    packed = torch.cat([expert_index.to(gate.dtype), gate.detach(), dispatched.to(gate.dtype)], dim=1)
    everyone, member_rows = group.gather(packed if token_shape is None else packed.view(*token_shape, -1))
    group_tokens = everyone.shape[0]
    capacity = (None if capacity_factor is None
                else expert_capacity(group_tokens, num_experts, top_k, capacity_factor, min_capacity))
    all_expert = everyone[:, :top_k].long()
    all_gate = everyone[:, top_k:2 * top_k]
    all_dispatched = everyone[:, 2 * top_k:] > 0.5

    # Assignments in choice-major order: a = choice * N + token.
    expert_flat = torch.where(all_dispatched, all_expert, num_experts).t().reshape(-1)
    if drop_policy == "position":
        priority = None  # the assignment order itself
    elif drop_policy == "probs":
        choice = torch.arange(top_k, device=all_gate.device).repeat_interleave(group_tokens)
        priority = choice * 4.0 - all_gate.t().reshape(-1)  # gates in [0, 1]: choice dominates, then gate
    else:
        raise ValueError(f"model.moe.drop_policy='{drop_policy}' is not one of position, probs")
    order, rank = rank_within_expert(expert_flat, priority, num_experts)
    sorted_expert = expert_flat[order]
    routed = sorted_expert < num_experts
    kept = routed if capacity is None else routed & (rank < capacity)

    token_global = order % group_tokens
    choice = order // group_tokens
    # dropped assignments counted in a last bin and cut off: no boolean index, so no copy to the host
    tokens_per_expert = count_by_index(torch.where(kept, sorted_expert, num_experts), num_experts + 1)[:num_experts]
    dropped = 1.0 - kept.sum() / routed.sum().clamp_min(1)
    zero = gate.new_zeros(())
    aux = zero if prob_sum is None else load_balancing_loss(prob_sum, all_expert[:, 0], num_experts, group_tokens)
    z_loss = zero if log_normaliser is None else router_z_loss(log_normaliser, group_tokens)
    if member_rows is None and getattr(group, "static_rows", False):
        return static_rows_routing(token_global, choice, sorted_expert, kept, gate, num_experts, tokens_per_expert,
                                   dropped.float(), aux, z_loss)
    local_token = local_rows(token_global, member_rows, group_tokens)
    mine = (kept if member_rows is None else kept & (local_token >= 0)).nonzero().squeeze(1)
    token_index = local_token.index_select(0, mine)
    local_expert = sorted_expert.index_select(0, mine)
    # index_select, not gate[rows, cols]: the backward of advanced indexing is a slow accumulating index_put
    local_gate = gate.reshape(-1).index_select(0, token_index * top_k + choice.index_select(0, mine))

    return Routing(token_index=token_index, expert_index=local_expert, gate=local_gate,
                   local_tokens_per_expert=count_by_index(local_expert, num_experts),
                   tokens_per_expert=tokens_per_expert, dropped_fraction=dropped.float(),
                   aux_loss=aux, z_loss=z_loss, one_per_token=top_k == 1)


def static_rows_routing(token_index: torch.Tensor, choice: torch.Tensor, sorted_expert: torch.Tensor,
                        kept: torch.Tensor, gate: torch.Tensor, num_experts: int, tokens_per_expert: torch.Tensor,
                        dropped_fraction: torch.Tensor, aux_loss: torch.Tensor, z_loss: torch.Tensor) -> Routing:
    """The routing of one device's tokens with shapes that do not depend on the routing (no host sync: every
    tensor is sized by the token count, so the layer runs under CUDA graphs and ``torch.compile(fullgraph=True)``).

    All n*k assignments stay, in expert order; an assignment over capacity or not dispatched keeps its row with
    gate 0, so it adds exactly 0 to its token and to the weights' gradients. Rows are grouped by expert for
    grouped GEMMs (``row_ends``: cumulative ends); the undispatched tail (expert id E, sorted last) joins the last
    expert's group, so every row belongs to a group. Costs the dropped rows' FLOPs (the dropped fraction, a few
    percent at capacity factor 1.25) in exchange for no device-to-host copy per layer.
    """
    group_expert = sorted_expert.clamp_max(num_experts - 1)
    top_k = gate.shape[-1]
    rows_gate = gate.reshape(-1).index_select(0, token_index * top_k + choice)
    local_gate = torch.where(kept, rows_gate, rows_gate.new_zeros(()))
    return Routing(token_index=token_index, expert_index=group_expert, gate=local_gate,
                   local_tokens_per_expert=tokens_per_expert, tokens_per_expert=tokens_per_expert,
                   dropped_fraction=dropped_fraction, aux_loss=aux_loss, z_loss=z_loss, one_per_token=top_k == 1,
                   row_ends=count_by_index(group_expert, num_experts).cumsum(0))
