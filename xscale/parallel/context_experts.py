"""MoE layers under context parallelism: a cp group routes its microbatch's whole sequences together.

The cp ranks of a group hold slices of the same sequences (:mod:`xscale.parallel.context`) and every expert. Capacity
and the load-balancing fractions are properties of the routing group's tokens (GShard, Lepikhin et al. 2020, Alg. 1;
Switch, Fedus et al. 2021, eq. 3-4), and the position drop policy keeps earlier tokens first, so the group is the
tokens one device would route: every sequence of the microbatch, in sequence order. Each rank all-gathers the
routing decisions of the group's tokens (expert ids, gates, dispatch flags: a few numbers a token, never the hidden
states), puts them in global token order, makes the capacity cut as one device would, and applies its experts to
its own kept tokens. No hidden state moves between ranks. The auxiliary losses are each rank's share of the group's
(:mod:`xscale.models.moe.routing`), so with gradients summed over dp x cp they are one device's.

Under expert parallelism as well (``ep x cp``) the ep group's routing group is the cp-gathered sequences of each of its
ranks (:class:`xscale.parallel.expert.plan.ExpertParallelTokens` ``within``), and the kept tokens travel to their
experts' ranks over the ep group of this rank's cp coordinate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from xscale.parallel.collectives import all_gather_flat
from xscale.parallel.context import SequenceSlice
from xscale.runtime import Placement


class ContextParallelTokens:
    """The routing group of a cp group (a :class:`~xscale.runtime.ExpertExchange` whose experts are all local)."""

    experts_local = True

    def __init__(self, group: dist.ProcessGroup, layout: SequenceSlice) -> None:
        self.group, self.layout = group, layout

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows [B, T/cp, c] -> the group's [B x T, c] in global token order, and this rank's rows'
        places in it."""
        if rows.dim() != 3:
            raise ValueError(f"a context-parallel routing group needs this rank's rows batch first [B, T/cp, c], got "
                             f"shape {tuple(rows.shape)}: pass the router's token_shape")
        batch, local_length, width = rows.shape
        cp, length = self.layout.cp, local_length * self.layout.cp
        rows = rows.contiguous()
        gathered = rows.new_empty((cp, batch, local_length, width))
        all_gather_flat(gathered.view(-1), rows.view(-1), group=self.group)
        everyone = gathered.permute(1, 0, 2, 3).reshape(batch, length, width)  # rank-major within each sequence
        order = self.layout.global_order(length, rows.device)
        if order is not None:
            everyone = everyone.index_select(1, order)
        positions = self.layout.positions_of(self.layout.rank, length, rows.device)
        member_rows = (torch.arange(batch, device=rows.device)[:, None] * length + positions[None, :]).reshape(-1)
        return everyone.reshape(batch * length, width), member_rows

    def all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def dispatch(self, tokens_by_expert: torch.Tensor, tokens_per_expert: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        """Every expert is here: apply them to this rank's tokens, sorted by expert."""
        return experts(tokens_by_expert, tokens_per_expert.tolist())


def moe_routing_over(tokens: ContextParallelTokens) -> Placement:
    """What a forward under context parallelism (without expert parallelism) tells its MoE layers: route over the cp
    group."""
    return lambda context: context.with_experts(tokens)
