"""Apply a layout to a model, in a fixed order, and return the engine that runs its steps.

Order (as torchtitan settled on): build on the meta device -> pipeline split -> tensor/sequence parallel ->
expert parallel -> context parallel -> activation checkpointing -> ZeRO-3 (FSDP2) -> materialise on the device ->
deterministic init from (seed, canonical parameter name), so every layout starts from the single-device weights.
Context parallelism (cp > 1) hooks the attention cores and position encodings and slices each microbatch in the
loss function (:mod:`xscale.parallel.context`); its ranks hold the same parameters, so the data-parallel strategy
sums gradients over dp x cp and ZeRO shards over dp_shard x cp.
Expert parallelism (ep > 1) acts on the MoE layers only and slices materialised experts, so under ep the model is
materialised and initialised just before it (after tensor parallelism's plans on the meta model; under pp, in each
stage the pipeline engine has materialised).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.config import Config
from xscale.models import build_model
from xscale.models.init import canonical_name, init_weights
from xscale.models.moe import moe_layers
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.parallel.context import apply_context_parallel, context_parallel_loss_sum
from xscale.parallel.data import DataParallel, NamedParameter, ReplicatedDataParallel, ZeroDataParallel
from xscale.parallel.dims import ParallelDims
from xscale.parallel.engine import Engine, Placement, unplaced
from xscale.parallel.expert import apply_expert_parallel
from xscale.parallel.fsdp import FullyShardedDataParallel, apply_fsdp
from xscale.parallel.loss import model_loss_sum
from xscale.parallel.pipeline import PipelineEngine
from xscale.parallel.tensor import apply_tensor_parallel, tensor_parallel_context


def _stacks(model: nn.Module) -> list[nn.Module]:
    """The stacks of a model, or those a pipeline stage holds (an encoder-decoder stage may hold either or both)."""
    return [stack for stack in (getattr(model, "stack", None), getattr(model, "decoder", None)) if stack is not None]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The Transformer blocks of a model or of a pipeline stage (its ``stack``)."""
    return [block for stack in _stacks(model) for block in stack.layers.values()]


def replica_statistics(mesh: DeviceMesh, dims: ParallelDims) -> Placement:
    """Cores that keep running statistics of the tokens they see (``dp_statistics`` in their parallel_traits:
    routing attention's k-means sums) sum them over the data-parallel ranks with the context's
    ``sum_over_replicas``, so every rank moves them alike (as one device would on the whole batch). Over dp only: a
    tp rank holds the statistics of its own heads (:mod:`xscale.parallel.head_sharded`)."""
    if dims.dp == 1:
        return unplaced
    group = mesh["dp"].get_group()

    def all_reduce(statistics: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(statistics, group=group)
        return statistics

    return lambda context: replace(context, sum_over_replicas=all_reduce)


def _then(first: Placement, second: Placement) -> Placement:
    return lambda context: second(first(context))


def _compile_blocks(model: nn.Module, config: Config) -> None:
    """``train.compile``: compile each block's forward in place (after activation checkpointing, before FSDP, as
    torchtitan orders them); parameter names do not change."""
    if config.train.compile:
        for block in _blocks(model):
            block.compile()


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
        model = build_model(config.model, device, seed=seed).use_kernels(config.train.kernels)
        apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
        _compile_blocks(model, config)
        return Engine(model, micro_batch_size(config, dims), autocast)
    if dims.pp > 1:
        return _build_pipeline_engine(config, dims, mesh, device, autocast)

    model = build_model(config.model, materialize=False).use_kernels(config.train.kernels)
    loss_fn, place = model_loss_sum, unplaced
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.parallel.sequence_parallel)
        place = tensor_parallel_context(mesh["tp"], config.parallel.sequence_parallel)
    if dims.ep > 1:
        # Expert parallelism slices materialised experts, so the slices are rows of the single-process init.
        _materialize(model, config, device)
        apply_expert_parallel(model, mesh["ep"])
    if dims.cp > 1:
        layout = apply_context_parallel(model, mesh["cp"], load_balance=config.parallel.cp_load_balance)
        loss_fn = context_parallel_loss_sum(layout, loss_fn)
    apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
    _compile_blocks(model, config)
    make_data_parallel = _data_parallel([model], dims, mesh, autocast)
    if dims.ep == 1:
        _materialize(model, config, device)
    data_parallel = make_data_parallel([model])
    place = _then(place, replica_statistics(mesh, dims))
    return Engine(model, micro_batch_size(config, dims), autocast, loss_fn=loss_fn, data_parallel=data_parallel,
                  place=place)


def _materialize(model: nn.Module, config: Config, device: torch.device) -> None:
    """Allocate a meta-device (possibly already parallelised) model on ``device`` with the single-process init."""
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, config.model, config.train.seed)


def _data_parallel(parts: list[nn.Module], dims: ParallelDims, mesh: DeviceMesh, autocast: torch.dtype | None):
    """Shard ``parts`` for ZeRO-3 now (meta or materialised); return a factory that builds the strategy over
    the materialised parts."""
    stage_replicas = dims.world_size // dims.pp
    cp = dims.cp > 1  # the cp ranks hold the same parameters: gradients summed over dp x cp

    def parameters(modules: list[nn.Module]) -> list[NamedParameter]:
        return [entry for module in modules for entry in named_parameters(module)]

    if dims.zero_stage == 3 and dims.dp_cp > 1:
        for part in parts:
            experts = [layer.experts for layer in moe_layers(part)] if dims.ep > 1 else []
            apply_fsdp(part, mesh, dims, autocast, _blocks(part), expert_modules=experts)
        return lambda ms: FullyShardedDataParallel(parameters(ms), mesh, stage_replicas, ms, dims.ep, cp)
    if dims.zero_stage in (1, 2) and dims.dp_cp > 1:
        return lambda ms: ZeroDataParallel(parameters(ms), mesh, dims.zero_stage, stage_replicas, dims.ep, cp)
    if dims.dp_cp > 1:
        return lambda ms: ReplicatedDataParallel(parameters(ms), mesh, stage_replicas, dims.ep, cp)
    return lambda ms: DataParallel(parameters(ms), mesh, stage_replicas, dims.ep, cp)


def _build_pipeline_engine(config: Config, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                           autocast: torch.dtype | None) -> Engine:
    """Stages cut from the meta model, each tensor-parallel over ``tp`` (the first stage's embedding and the last
    stage's output projection split by vocabulary), activation-checkpointed and compiled before the engine
    materialises and initialises it; data parallel around them."""
    def parallelize_stage(stage: nn.Module) -> None:
        if dims.tp > 1:
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=config.parallel.sequence_parallel)
        apply_activation_checkpointing(_stacks(stage), config.parallel.activation_checkpointing)
        _compile_blocks(stage, config)

    model = build_model(config.model, materialize=False).use_kernels(config.train.kernels)
    place = tensor_parallel_context(mesh["tp"], config.parallel.sequence_parallel) if dims.tp > 1 else unplaced
    place = _then(place, replica_statistics(mesh, dims))  # each stage's cores over the stage's dp replicas
    engine = PipelineEngine.from_config(config, model, mesh["pp"], device, parallelize_stage, place)
    if dims.ep > 1:  # the stages are materialised with the single-process init; keep this rank's experts
        for stage in engine.model_parts:
            if moe_layers(stage):
                apply_expert_parallel(stage, mesh["ep"])
    engine.data_parallel = _data_parallel(engine.model_parts, dims, mesh, autocast)(engine.model_parts)
    return engine
