"""MoE layers over the routing groups of one step: the auxiliary-loss weight and the step's routing statistics.

A routing group is the tokens one forward routes together: one microbatch on one rank, gathered over the ep group
under expert parallelism (capacity and load-balancing fractions are computed over it, Lepikhin et al. 2020), and over
the cp group under context parallelism (whose ranks hold slices of the same sequences,
:mod:`xscale.parallel.context_experts`). A step of k microbatches on dp data-parallel ranks has G = k x dp / ep of
them, in every layout: the single process with micro_batch_size = one group's sequences routes exactly the same
groups.

- Auxiliary losses (Switch eq. 4, ST-MoE eq. 5) count as their mean over the G groups: each forward's are weighted
  1/G (``StepContext.moe_loss_scale``, which the step gives every forward), and gradients sum over microbatches
  and ranks. Under ep the ranks of a group
  each back-propagate their share of the group's losses (:mod:`xscale.models.moe.routing`), so a group counts once.
- Statistics reported for the step: tokens per expert summed over the G groups; dropped fraction, aux and z losses
  averaged over them. A forward hook adds each forward's group values (identical on the group's ep ranks); the
  sums and forward counts are then summed over the ranks that route different groups (``edp``); the step returns
  them (the trainer logs them), the layers are not written to. Averaging over
  recorded forwards makes activation checkpointing's recomputed forwards (same values, every group alike) harmless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from xscale.models.moe import MoELayer, moe_layers, routing_summary

AVERAGED = ("dropped_fraction", "aux_loss", "z_loss")


def _statistics(layer: MoELayer) -> torch.Tensor:
    """[tokens per expert..., dropped fraction, aux, z] of the layer's last forward."""
    metrics = layer.metrics
    return torch.cat([metrics["tokens_per_expert"].detach().float().reshape(-1),
                      torch.stack([metrics[name].detach().float().reshape(()) for name in AVERAGED])])


class RoutingGroups:
    """The MoE layers of this rank's model parts; the trainer's step calls :meth:`begin_step` and :meth:`end_step`
    around each training step (every microbatch's forward and backward in between).

    ``groups_per_microbatch``: dp / ep (1 on one device). ``sum_over_groups``: in-place sum of a tensor over the
    ranks that route different groups (None on one device).
    """

    def __init__(self, parts: list[nn.Module], groups_per_microbatch: int = 1,
                 sum_over_groups: Callable[[torch.Tensor], None] | None = None) -> None:
        self.layers: list[MoELayer] = [layer for part in parts for layer in moe_layers(part)]
        self.groups_per_microbatch = groups_per_microbatch
        self.sum_over_groups = sum_over_groups
        self.groups = 1
        self.step_metrics: dict[MoELayer, dict[str, torch.Tensor]] = {}
        self._recording = False
        self._sums: list[torch.Tensor | None] = [None] * len(self.layers)
        self._forwards = [0] * len(self.layers)
        for index, layer in enumerate(self.layers):
            layer.register_forward_hook(lambda module, args, output, index=index: self._record(index))

    def _record(self, index: int) -> None:
        if not self._recording:
            return
        value = _statistics(self.layers[index])
        total = self._sums[index]
        self._sums[index] = value if total is None else total + value
        self._forwards[index] += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside record nothing (a pipeline runtime's metadata-inference forward, on placeholders)."""
        recording, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = recording

    def begin_step(self, microbatches: int) -> float:
        """Start recording statistics; returns 1/G, the weight of each forward's auxiliary losses."""
        self.groups = microbatches * self.groups_per_microbatch
        self._sums = [None] * len(self.layers)
        self._forwards = [0] * len(self.layers)
        self._recording = True
        return 1.0 / self.groups

    def end_step(self) -> dict[MoELayer, dict[str, torch.Tensor]]:
        """The step's statistics of each layer (collective over the routing groups when distributed), also kept in
        :attr:`step_metrics` until the next step; the layers' own ``metrics`` stay their last forward's."""
        self._recording = False
        self.step_metrics = {}
        if not self.layers or any(total is None for total in self._sums):
            return self.step_metrics
        sizes = [total.numel() for total in self._sums]
        device = self._sums[0].device
        flat = torch.cat([*self._sums, torch.tensor(self._forwards, dtype=torch.float32, device=device)])
        if self.sum_over_groups is not None:
            self.sum_over_groups(flat)
        totals, forwards = flat[:sum(sizes)].split(sizes), flat[sum(sizes):]
        for layer, total, count in zip(self.layers, totals, forwards):
            mean = total / count  # per routing group
            tokens, averaged = mean[:-len(AVERAGED)] * self.groups, mean[-len(AVERAGED):]
            self.step_metrics[layer] = {"tokens_per_expert": tokens, **dict(zip(AVERAGED, averaged))}
        return self.step_metrics

    def layer_summary(self, layer: nn.Module) -> dict[str, float] | None:
        """The last step's statistics of ``layer`` as the trainer logs them, or None (not one of the step's layers,
        or no step recorded yet)."""
        metrics = self.step_metrics.get(layer)
        return None if metrics is None else routing_summary(metrics)
