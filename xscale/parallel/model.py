"""A model under a layout: the parts this rank holds, and what the layout does around them.

:func:`xscale.parallel.parallelize.parallelize` returns one; the trainer's step (:mod:`xscale.train.step`) runs
it. What the layout contributes is small and named:
  ``data_parallel``  gradient sums and ZeRO's optimizer step (:mod:`xscale.parallel.data`; one replica: nothing)
  ``pipeline``       under pp > 1, the schedule that runs a step's forwards and backwards over the stages
  ``place``          what every forward's context must say about this rank (its heads, tokens, replicas)
  ``shard_batch``    the part of a microbatch this rank computes (context parallelism: its tokens)
and the state-dict adapter below, which names model and optimizer state in single-process terms (every expert, a
stage's copies under their source's name), so DCP reshards checkpoints between layouts.

A routing group is the tokens one forward routes together: one microbatch on one rank, gathered over the ep group
under expert parallelism. A step has G = microbatches x (dp / ep) of them (:mod:`xscale.parallel.expert.routing_groups`).
The single process routes one microbatch at a time, so its routing matches a layout's when its micro_batch_size
equals the sequences of one routing group; the data split follows the microbatches
(:meth:`GlobalSampler.shard <xscale.data.sampler.GlobalSampler.shard>`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from xscale.models.init import canonical_name
from xscale.parallel.data import DataParallel, NamedParameter
from xscale.parallel.data.grad_norm import GradientPiece
from xscale.parallel.expert.routing_groups import RoutingGroups
from xscale.parallel.expert.state import globalize_expert_state, localize_expert_state
from xscale.parallel.sdpa_backend import sdpa_backend_context
from xscale.runtime import Placement, StepContext

Batch = dict[str, torch.Tensor]
# What the layout adds to every forward's context (tensor parallelism: the rank's heads; identity on one device).
# Optimizer state flattened to ``state.<name>.<key>`` / ``param_groups.<name>.<key>``: nested param groups are
# saved by group index, which collides when ranks hold different parameters (pipeline stages).
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def unplaced(context: StepContext) -> StepContext:
    return context


def whole_batch(batch: Batch) -> Batch:
    return batch


def named_parameters(parts: list[nn.Module]) -> list[NamedParameter]:
    """Each parameter once, under the name it has in the single-process model."""
    return [NamedParameter(canonical_name(name), param) for part in parts for name, param in part.named_parameters()]


class ParallelModel:
    """This rank's model parts under a layout (see the module docstring)."""

    def __init__(self, parts: list[nn.Module], data_parallel: DataParallel | None = None, *, micro_batch_size: int,
                 autocast_dtype: torch.dtype | None = None, place: Placement = unplaced,
                 shard_batch: Callable[[Batch], Batch] = whole_batch, pipeline=None, sdpa_backend: str = "auto") -> None:
        self.parts = list(parts)
        self.data_parallel = data_parallel if data_parallel is not None else DataParallel(named_parameters(self.parts))
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype
        self.place = place
        self.shard_batch = shard_batch
        self.pipeline = pipeline  # xscale.parallel.pipeline.PipelineSchedule, or None
        self.sdpa_backend = sdpa_backend

    @property
    def model(self) -> nn.Module:
        """The one model this rank runs (every layout but a pipeline's)."""
        if self.pipeline is not None:
            raise ValueError("a pipeline rank holds stages (ParallelModel.parts), not one model")
        return self.parts[0]

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's numerics: bf16 autocast under ``train.precision=bf16``, the pinned SDPA kernel under
        ``train.sdpa_backend`` (:mod:`xscale.parallel.sdpa_backend`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                           enabled=self.autocast_dtype is not None))
        stack.enter_context(sdpa_backend_context(self.sdpa_backend))
        return stack

    def microbatches_per_batch(self, rows: int) -> int:
        """How many microbatches a rank's batch of ``rows`` sequences is run as (the data split follows them)."""
        if self.pipeline is not None:
            return self.pipeline.microbatches
        return max(1, rows // self.micro_batch_size)

    @functools.cached_property
    def routing_groups(self) -> RoutingGroups:
        """This rank's MoE layers and how the step's routing groups spread over the layout."""
        return RoutingGroups(self.parts, self.data_parallel.routing_groups, self.data_parallel.sum_over_routing_groups)

    def gradient_pieces(self) -> list[GradientPiece]:
        """This rank's gradients for the global norm (a pipeline's copies of a shared parameter counted once)."""
        uncounted = () if self.pipeline is None else {id(param) for param in self.pipeline.shared.uncounted}
        return self.data_parallel.gradient_pieces(uncounted=uncounted)

    # ------------------------------------------------------------------ checkpoints
    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The ep mesh when experts are sharded over ranks (their checkpoint tensors are then global views)."""
        if self.data_parallel.expert_parallel > 1:
            return self.data_parallel.mesh["ep"]
        return None

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by canonical parameter names, in single-process shapes (expert tensors
        included: :mod:`xscale.parallel.expert.state`), so DCP reshards them to any layout."""
        view = self._view()
        custom = self.data_parallel.optimizer_state_dict(optimizer)
        if custom is not None:
            model_state, optimizer_state = get_model_state_dict(view), custom
        else:
            model_state, optimizer_state = get_state_dict(view, optimizer, options=STATE_DICT_OPTIONS)
        state = {"model": model_state, "optimizer": optimizer_state}
        if self.pipeline is not None:
            state = self.pipeline.to_single_process_names(state)
        return state if self.expert_mesh is None else globalize_expert_state(state, self.expert_mesh)

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Load a state of :meth:`state_dict`'s form (after DCP filled it from a checkpoint of any layout)."""
        if self.expert_mesh is not None:
            state = localize_expert_state(state, self.parts)
        view = self._view()
        if self.pipeline is not None:
            state = self.pipeline.from_single_process_names(state, view)
        if self.data_parallel.optimizer_state_dict(optimizer) is not None:
            set_model_state_dict(view, state["model"])
            self.data_parallel.load_optimizer_state_dict(optimizer, state["optimizer"])
            return
        set_state_dict(view, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=STATE_DICT_OPTIONS)

    def _view(self) -> nn.Module | list[nn.Module]:
        if self.pipeline is not None:
            return self.pipeline.state_view()
        return self.parts[0] if len(self.parts) == 1 else self.parts
