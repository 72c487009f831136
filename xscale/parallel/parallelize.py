"""Apply a layout to a model, in a fixed order, and return the engine that runs its steps.

Order (as torchtitan settled on): build on the meta device -> pipeline split -> tensor/sequence parallel ->
expert parallel -> activation checkpointing -> ZeRO-3 (FSDP2) -> materialise on the device -> deterministic init
from (seed, canonical parameter name), so every layout starts from the single-device weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.config import Config, ConfigError
from xscale.models import build_model
from xscale.models.init import canonical_name, init_weights
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.parallel.data import DataParallel, NamedParameter, ReplicatedDataParallel, ZeroDataParallel
from xscale.parallel.dims import ParallelDims
from xscale.parallel.engine import Engine, model_loss_sum


def _stacks(model: nn.Module) -> list[nn.Module]:
    return [model.stack] + ([model.decoder] if getattr(model, "decoder", None) is not None else [])


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [block for stack in _stacks(model) for block in stack.layers.values()]


def named_parameters(model: nn.Module) -> list[NamedParameter]:
    """Each parameter once, under the name it has in the single-process model."""
    return [NamedParameter(canonical_name(name), param) for name, param in model.named_parameters()]


def micro_batch_size(config: Config, dims: ParallelDims) -> int:
    local = config.train.global_batch_size // dims.dp
    return config.train.micro_batch_size or local


def build_engine(config: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device) -> Engine:
    """The model of this rank, parallelised, materialised and initialised, inside its step engine."""
    seed = config.train.seed
    autocast = torch.bfloat16 if config.train.precision == "bf16" else None
    if mesh is None or dims.world_size == 1:
        model = build_model(config.model, device, seed=seed)
        apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
        return Engine(model, micro_batch_size(config, dims), autocast)
    if dims.pp > 1:
        from xscale.parallel.pipeline_layout import build_pipeline_engine

        return build_pipeline_engine(config, dims, mesh, device)

    model = build_model(config.model, materialize=False)
    loss_fn = model_loss_sum
    if dims.tp > 1:
        from xscale.parallel.tensor import apply_tensor_parallel, tensor_parallel_loss_sum

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.parallel.sequence_parallel)
        loss_fn = tensor_parallel_loss_sum
    if dims.ep > 1:
        raise ConfigError("expert parallelism in the trainer arrives with the MoE layout work; use parallel.ep=1")
    apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
    data_parallel = _data_parallel(model, dims, mesh, autocast)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, config.model, seed)
    data_parallel = data_parallel(model)
    return Engine(model, micro_batch_size(config, dims), autocast, loss_fn=loss_fn, data_parallel=data_parallel)


def _data_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, autocast: torch.dtype | None):
    """Shard for ZeRO-3 now (on the meta model); return a factory that builds the strategy once materialised."""
    stage_replicas = dims.world_size // dims.pp
    if dims.zero_stage == 3 and dims.dp > 1:
        from xscale.parallel.fsdp import FullyShardedDataParallel, apply_fsdp

        apply_fsdp(model, mesh, dims, autocast, _blocks(model))
        return lambda m: FullyShardedDataParallel(named_parameters(m), mesh, stage_replicas, [m], dims.ep)
    if dims.zero_stage in (1, 2) and dims.dp > 1:
        return lambda m: ZeroDataParallel(named_parameters(m), mesh, dims.zero_stage, stage_replicas, dims.ep)
    if dims.dp > 1:
        return lambda m: ReplicatedDataParallel(named_parameters(m), mesh, stage_replicas, dims.ep)
    return lambda m: DataParallel(named_parameters(m), mesh, stage_replicas, dims.ep)
