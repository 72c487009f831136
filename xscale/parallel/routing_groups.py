"""MoE layers over the routing groups of one step: the auxiliary-loss weight and the step's routing statistics.

A routing group is the tokens one forward routes together: one microbatch on one rank, gathered over the ep group
under expert parallelism (capacity and load-balancing fractions are computed over it, Lepikhin et al. 2020). A step
of k microbatches on dp data-parallel ranks has G = k x dp / ep of them, in every layout: the single process with
micro_batch_size = one group's sequences routes exactly the same groups.

- Auxiliary losses (Switch eq. 4, ST-MoE eq. 5) count as their mean over the G groups: each forward's are weighted
  1/G (``MoELayer.aux_loss_scale``), and gradients sum over microbatches and ranks. Under ep the ranks of a group
  each back-propagate their share of the group's losses (:mod:`xscale.models.moe.routing`), so a group counts once.
- Statistics reported for the step: tokens per expert summed over the groups; dropped fraction, aux and z losses
  averaged over them. Each forward records its group's values (identical on the group's ep ranks); the step's
  are summed over microbatches, then over the ranks that route different groups (``edp``: one per ep group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from xscale.models.moe import MoELayer, moe_layers

AVERAGED = ("dropped_fraction", "aux_loss", "z_loss")


class RoutingGroups:
    """The MoE layers of this rank's model parts, driven once per step by the engine.

    ``groups_per_microbatch``: dp / ep (1 on one device). ``sum_over_groups``: in-place sum of a tensor over the
    ranks that hold different routing groups (None on one device).
    """

    def __init__(self, parts: list[nn.Module], groups_per_microbatch: int = 1,
                 sum_over_groups: Callable[[torch.Tensor], None] | None = None) -> None:
        self.layers: list[MoELayer] = [layer for part in parts for layer in moe_layers(part)]
        self.groups_per_microbatch = groups_per_microbatch
        self.sum_over_groups = sum_over_groups
        self.groups = 1
        self._sums: list[torch.Tensor] = []

    def begin_step(self, microbatches: int) -> None:
        """Weight the auxiliary losses of each of the step's forwards by 1/G."""
        self.groups = microbatches * self.groups_per_microbatch
        for layer in self.layers:
            layer.aux_loss_scale = 1.0 / self.groups
        self._sums = []

    def after_microbatch(self) -> None:
        """Add the statistics of the microbatch that just ran (forward and backward)."""
        values = [torch.cat([layer.metrics["tokens_per_expert"].float().reshape(-1),
                             torch.stack([layer.metrics[name].float().reshape(()) for name in AVERAGED])])
                  for layer in self.layers]
        self._sums = values if not self._sums else [total + value for total, value in zip(self._sums, values)]

    def end_step(self) -> None:
        """Replace each layer's ``metrics`` by the step's (collective over the routing groups when distributed)."""
        if not self.layers or not self._sums:
            return
        flat = torch.cat(self._sums)
        if self.sum_over_groups is not None:
            self.sum_over_groups(flat)
        for layer, total in zip(self.layers, flat.split([s.numel() for s in self._sums])):
            tokens, averaged = total[:-len(AVERAGED)], total[-len(AVERAGED):] / self.groups
            layer.metrics = {"tokens_per_expert": tokens, **dict(zip(AVERAGED, averaged))}
