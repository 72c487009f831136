"""Peers for ``xscale bench parallel``: torch's own data parallelism on the same model and batch.

A peer trains a fresh single-process copy of the run's model (same config, same init) in the same processes as the
xscale layout it is compared with, on the batch that layout trains on: DDP layouts and ZeRO-1/2 are compared with
``torch.nn.parallel.DistributedDataParallel``, ZeRO-3 with FSDP2 ``fully_shard`` (each block a unit, then the root).
DeepSpeed is not a peer: on CPU with gloo its ``deepspeed.initialize`` (0.19.8) did not return within 100 s even for a
two-layer model at ZeRO-1 (it waits on its accelerator's communication setup). A peer step
does what an xscale step does: each microbatch's summed token loss over the global token count, backward (the
peer's own overlapped gradient reduction), clipping to ``train.grad_clip`` and an AdamW step.

The ``local`` step is the same step with no wrapper and no gradient communication: each rank trains its own copy on
its share of the batch. No data-parallel implementation's step can be shorter (it does that compute and then some),
so ``peer step / local step`` bounds what any xscale/peer ratio can reach: the ceiling the bench prints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from xscale.config.schema import Config
from xscale.models import build_model
from xscale.models.init import init_weights
from xscale.parallel.loss import model_loss_sum
from xscale.parallel.model import Batch
from xscale.runtime import StepContext
from xscale.train.optim import build_optimizer
from xscale.train.step import split_microbatches

PeerStep = Callable[[Batch], None]


class LossModel(nn.Module):
    """The model with its loss inside ``forward``, so a wrapper sees every parameter used in its forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        return model_loss_sum(self.model, batch, StepContext())


LOCAL = "local"


def peer_for(zero_stage: int) -> str:
    """The peer an xscale data-parallel layout is compared with."""
    return "fsdp2" if zero_stage == 3 else "torch-ddp"


def _fresh_model(config: Config, device: torch.device) -> LossModel:
    model = build_model(config.model, materialize=False).use_kernels(
        config.train.kernels, config.train.sparse_attention)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, config.model, config.train.seed)
    return LossModel(model)


def _blocks(model: nn.Module) -> list[nn.Module]:
    stacks = [getattr(model, name, None) for name in ("stack", "decoder")]
    return [block for stack in stacks if stack is not None for block in stack.layers.values()]


def build_peer(name: str, config: Config, group: dist.ProcessGroup, mesh, device: torch.device,
               micro_batch_size: int) -> PeerStep:
    """A step function for peer ``name`` over the data-parallel ``group`` (``mesh``: its 1-D DeviceMesh); ``local``:
    the communication-free step of the module docstring."""
    loss_model = _fresh_model(config, device)
    if name == LOCAL:
        wrapped: nn.Module = loss_model

        def no_sync(last: bool):
            return contextlib.nullcontext()
    elif name == "fsdp2":
        for block in _blocks(loss_model.model):
            fully_shard(block, mesh=mesh)
        fully_shard(loss_model, mesh=mesh, reshard_after_forward=False)
        wrapped = loss_model

        def no_sync(last: bool):
            loss_model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
    else:
        wrapped = DistributedDataParallel(loss_model, process_group=group)

        def no_sync(last: bool):
            return contextlib.nullcontext() if last else wrapped.no_sync()
    params = list(loss_model.parameters())
    optimizer = build_optimizer(params, config.train)
    world = dist.get_world_size(group)

    def step(batch: Batch) -> None:
        tokens = (batch["labels"] != -100).sum()
        dist.all_reduce(tokens, group=group)
        # DDP and FSDP2 average gradients over the group; scaling the loss by world size makes that the sum
        scale = world / tokens.clamp_min(1)
        micros = split_microbatches(batch, micro_batch_size)
        for index, micro in enumerate(micros):
            with no_sync(index == len(micros) - 1):
                (wrapped(micro) * scale).backward()
        if config.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step
