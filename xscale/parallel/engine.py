"""How one optimizer step's forward and backward run under a layout.

The trainer knows neither the model variant nor the layout: it hands each step's batch (this
data-parallel rank's share of the global batch) to an :class:`Engine`. The contract every engine
keeps, and the parity tests check: the loss it returns and the gradients it leaves are those of
the single-process model on the whole global batch, where the loss is the mean token
cross-entropy over every labelled token of the global batch, plus the MoE auxiliary losses averaged
over the step's routing groups.

A routing group is the tokens one forward routes together: one microbatch on one rank, gathered over
the ep group under expert parallelism. A step has G = microbatches x (dp / ep) of them; each MoE
layer's auxiliary losses are weighted 1/G and its reported statistics are the step's
(:mod:`xscale.parallel.routing_groups`). The single process routes one microbatch at a time, so its
routing matches a layout's when its micro_batch_size equals the sequences of one routing group
(ep x the per-rank micro_batch_size): the data split follows the microbatches
(:meth:`GlobalSampler.shard <xscale.data.sampler.GlobalSampler.shard>`), so a group is a contiguous run of
the global batch, in the order the single process reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh

from xscale.config import TrainConfig
from xscale.models.training_step import begin_training_step
from xscale.parallel.data import DataParallel
from xscale.parallel.expert_state import globalize_expert_state, localize_expert_state
from xscale.parallel.grad_norm import clip_gradients
from xscale.parallel.loss import Batch, model_loss_sum
from xscale.parallel.routing_groups import RoutingGroups
from xscale.runtime import StepContext
from xscale.train.optim import build_optimizer

LossFunction = Callable[[nn.Module, Batch, StepContext | None], torch.Tensor]
# What the layout adds to every forward's context (tensor parallelism: the rank's heads; identity on one device).
Placement = Callable[[StepContext], StepContext]


def unplaced(context: StepContext) -> StepContext:
    return context
# Optimizer state flattened to ``state.<name>.<key>`` / ``param_groups.<name>.<key>``: nested param groups are
# saved by group index, which collides when ranks hold different parameters (pipeline stages).
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def split_microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    size = batch["input_ids"].shape[0]
    return [{key: value[start:start + micro_batch_size] for key, value in batch.items()}
            for start in range(0, size, micro_batch_size)]


class Engine:
    """Runs a step's microbatches on this rank's model; data parallelism is delegated to a strategy object.

    ``loss_fn(model, microbatch, context)`` returns the summed token loss (:mod:`xscale.parallel.loss`);
    ``data_parallel`` (:mod:`xscale.parallel.data`) reduces token counts, losses and gradients over the
    data-parallel ranks and owns the optimizer step (ZeRO). Without one the engine is the single-device trainer.
    """

    def __init__(self, model: nn.Module, micro_batch_size: int, autocast_dtype: torch.dtype | None = None, *,
                 loss_fn: LossFunction = model_loss_sum, data_parallel: DataParallel | None = None,
                 place: Placement = unplaced) -> None:
        self.model = model
        self.place = place
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype
        self.loss_fn = loss_fn
        self.data_parallel = data_parallel

    @property
    def distributed(self) -> bool:
        return self.data_parallel is not None

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules this rank holds (one, or several pipeline stages)."""
        return [self.model]

    @property
    def data_parallel_replicas(self) -> int:
        return self.data_parallel.replicas if self.distributed else 1

    def microbatches_per_batch(self, rows: int) -> int:
        """How many microbatches a rank's batch of ``rows`` sequences is run as (the data split follows them)."""
        return max(1, rows // self.micro_batch_size)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def _autocast(self):
        device_type = next(self.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def global_token_count(self, batch: Batch) -> torch.Tensor:
        """Labelled tokens in the global batch (summed over the data-parallel ranks)."""
        local = (batch["labels"] != -100).sum()
        return self.data_parallel.global_token_count(local) if self.distributed else local

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Combine per-rank partial losses into the global one (identity on one device)."""
        return self.data_parallel.reduce_loss(local).cpu() if self.distributed else local.cpu()

    @functools.cached_property
    def routing_groups(self) -> RoutingGroups:
        """This rank's MoE layers and how the step's routing groups spread over the layout."""
        if not self.distributed:
            return RoutingGroups(self.model_parts)
        return RoutingGroups(self.model_parts, self.data_parallel.routing_groups,
                             self.data_parallel.sum_over_routing_groups)

    def train_step(self, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
        """Forward + backward over the microbatches; returns the global-batch mean loss (detached).

        ``context``: where ``batch`` sits in the run (step, first global sample); each microbatch's dropout
        masks are then those of its rows in the global batch, as on one device (:mod:`xscale.models.dropout`).
        """
        for part in self.model_parts:
            part.train()
        tokens = self.global_token_count(batch).clamp_min(1)
        total = torch.zeros((), dtype=torch.float32, device=self._device())
        micros = split_microbatches(batch, self.micro_batch_size)
        moe_loss_scale = self.routing_groups.begin_step(len(micros))
        begin_training_step(self.model_parts, len(micros) * self.data_parallel_replicas)
        for index, micro in enumerate(micros):
            if self.distributed:
                self.data_parallel.requires_gradient_sync(index == len(micros) - 1)
            micro_context = context.microbatch(index, self.micro_batch_size) if context is not None else StepContext()
            micro_context = replace(self.place(micro_context), moe_loss_scale=moe_loss_scale)
            with self._autocast():
                loss = self.loss_fn(self.model, micro, micro_context) / tokens
            loss.backward()
            total += loss.detach().float()
        if self.distributed:
            self.data_parallel.after_backward()
        self.routing_groups.end_step()
        return self.reduce_loss(total)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        for part in self.model_parts:
            part.eval()
        tokens = self.global_token_count(batch).clamp_min(1)
        total = torch.zeros((), dtype=torch.float32, device=self._device())
        for micro in split_microbatches(batch, self.micro_batch_size):
            with self._autocast():
                total += (self.loss_fn(self.model, micro, self.place(StepContext())) / tokens).float()
        return self.reduce_loss(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) and return the global gradient norm."""
        if self.distributed:
            return clip_gradients(self.data_parallel.gradient_pieces(), max_norm)
        params = [p for p in self.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def build_optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        """AdamW over what this rank updates: whole parameters, DTensor shards or ZeRO chunks."""
        if not self.distributed:
            return build_optimizer(self.parameters(), train)
        params = self.data_parallel.optimizer_parameters()
        source_ndim = {id(shard): entry.param.ndim
                       for shard, entry in zip(params, self.data_parallel.parameters)}
        return build_optimizer(params, train, source_ndim)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.distributed:
            self.data_parallel.optimizer_step(optimizer)
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The ep mesh when experts are sharded over ranks (their checkpoint tensors are then global views)."""
        if self.distributed and self.data_parallel.expert_parallel > 1:
            return self.data_parallel.mesh["ep"]
        return None

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by canonical parameter names, in single-process shapes (expert
        tensors included: :mod:`xscale.parallel.expert_state`), so DCP reshards them to any layout."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        custom = self.data_parallel.optimizer_state_dict(optimizer) if self.distributed else None
        if custom is not None:
            state = {"model": get_model_state_dict(self._state_module()), "optimizer": custom}
        else:
            model_state, optimizer_state = get_state_dict(self._state_module(), optimizer,
                                                          options=STATE_DICT_OPTIONS)
            state = {"model": model_state, "optimizer": optimizer_state}
        if self.expert_mesh is not None:
            state = globalize_expert_state(state, self.expert_mesh)
        return state

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Load a state of :meth:`state_dict`'s form (after DCP filled it from a checkpoint of any layout)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.expert_mesh is not None:
            state = localize_expert_state(state, self._state_module())
        if self.distributed and self.data_parallel.optimizer_state_dict(optimizer) is not None:
            set_model_state_dict(self._state_module(), state["model"])
            self.data_parallel.load_optimizer_state_dict(optimizer, state["optimizer"])
            return
        set_state_dict(self._state_module(), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=STATE_DICT_OPTIONS)

    def _state_module(self) -> nn.Module | list[nn.Module]:
        parts = self.model_parts
        return parts[0] if len(parts) == 1 else parts
