"""Apply a layout to a model, in a fixed order: :func:`parallelize` returns the :class:`ParallelModel` that the
trainer's step runs.

Order (as torchtitan settled on): build on the meta device -> pipeline split -> tensor/sequence parallel ->
expert parallel -> context parallel -> activation checkpointing -> ZeRO-3 (FSDP2) -> materialise on the device ->
deterministic init from (seed, canonical parameter name), so every layout starts from the single-device weights.
Context parallelism (cp > 1) hooks the attention cores, cuts each microbatch to the rank's tokens and tells every
forward which global positions they are (:mod:`xscale.parallel.context`); its ranks hold the same parameters, so the data-parallel strategy
sums gradients over dp x cp and ZeRO shards over dp_shard x cp.
Expert parallelism (ep > 1) acts on the MoE layers only and slices materialised experts, so under ep the model is
materialised and initialised just before it (after tensor parallelism's plans on the meta model; under pp, in each
stage the pipeline schedule has materialised).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.config.schema import Config, ParallelConfig
from xscale.models import build_model
from xscale.models.init import init_weights
from xscale.models.moe import moe_layers
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.parallel.context import SequenceSlice, apply_context_parallel
from xscale.parallel.context_experts import ContextParallelTokens, moe_routing_over
from xscale.parallel.data import DataParallel, ReplicatedDataParallel, ZeroDataParallel
from xscale.parallel.data.fsdp import FullyShardedDataParallel, apply_fsdp
from xscale.parallel.dims import ParallelDims
from xscale.parallel.expert import apply_expert_parallel, expert_parallel_context
from xscale.parallel.model import ParallelModel, Placement, named_parameters, unplaced, whole_batch
from xscale.parallel.pipeline import PipelineSchedule
from xscale.parallel.pipeline.schedules import SCHEDULES
from xscale.parallel.sdpa_backend import check_sdpa_backend
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
    tp rank holds the statistics of its own heads (:mod:`xscale.parallel.tensor.head_sharded`)."""
    if dims.dp == 1:
        return unplaced
    group = mesh["dp"].get_group()

    def all_reduce(statistics: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(statistics, group=group)
        return statistics

    return lambda context: replace(context, sum_over_replicas=all_reduce)


def _then(first: Placement, second: Placement) -> Placement:
    return lambda context: second(first(context))


def compile_blocks(model: nn.Module) -> None:
    """Compile each Transformer block's forward in place (``nn.Module.compile``): parameter names do not change."""
    for block in _blocks(model):
        block.compile()


def _compile_blocks(model: nn.Module, config: Config) -> None:
    """``train.compile``: :func:`compile_blocks` after activation checkpointing, before FSDP, as torchtitan orders
    them. A schedule that splits each stage's backward in two halves over one graph (``retain_graph``, zero bubble)
    needs the compiled backwards to keep their saved buffers: AOTAutograd's donation of them is turned off."""
    if config.train.compile:
        if config.parallel.pp > 1 and SCHEDULES[config.parallel.pp_schedule].splits_backward:
            import torch._functorch.config  # only a compiled run loads it (start-up: xscale/runtime/eager.py)

            torch._functorch.config.donated_buffer = False
        compile_blocks(model)


def _numerics(model: nn.Module, config: Config, device: torch.device) -> nn.Module:
    """The model's kernels (``train.kernels``, ``train.sparse_attention``) and, under ``train.precision=fp8``, its
    block linears in FP8 (:mod:`xscale.models.float8`), before any layout touches it."""
    model = model.use_kernels(config.train.kernels, config.train.sparse_attention)
    if config.train.precision == "fp8":
        model.use_float8(config.train.fp8_recipe, device)
    return model


def micro_batch_size(config: Config, dims: ParallelDims) -> int:
    local = config.train.global_batch_size // dims.dp
    return config.train.micro_batch_size or local


def parallelize(config: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device) -> ParallelModel:
    """The model of this rank, parallelised, materialised and initialised, with what its layout does around it."""
    autocast = torch.bfloat16 if config.train.low_precision else None
    check_sdpa_backend(config.train.sdpa_backend, device.type)
    if mesh is None or dims.world_size == 1:
        model = _numerics(build_model(config.model, device, seed=config.train.seed), config, device)
        apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
        _compile_blocks(model, config)
        return ParallelModel([model], micro_batch_size=micro_batch_size(config, dims), autocast_dtype=autocast,
                             sdpa_backend=config.train.sdpa_backend)
    if dims.pp > 1:
        return _parallelize_pipeline(config, dims, mesh, device, autocast)

    model = _numerics(build_model(config.model, materialize=False), config, device)
    place, shard_batch = _tensor_parallel_place(config, dims, mesh), whole_batch
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.parallel.sequence_parallel)
    routing_within = None
    if dims.cp > 1:
        layout = apply_context_parallel(model, mesh["cp"], load_balance=config.parallel.cp_load_balance)
        place, shard_batch = _then(place, lambda context: context.with_sequence(layout)), layout.shard_batch
        routing_within = ContextParallelTokens(mesh["cp"].get_group(), layout)
    if dims.ep > 1:
        # Expert parallelism slices materialised experts, so the slices are rows of the single-process init.
        _materialize(model, config, device)
        place = _then(place, apply_expert_parallel(model, mesh["ep"], within=routing_within))
    elif routing_within is not None:  # MoE layers (if any) route over the cp group
        place = _then(place, moe_routing_over(routing_within))
    apply_activation_checkpointing(_stacks(model), config.parallel.activation_checkpointing)
    _compile_blocks(model, config)
    make_data_parallel = _data_parallel([model], dims, mesh, autocast, config.parallel)
    if dims.ep == 1:
        _materialize(model, config, device)
    return ParallelModel([model], make_data_parallel([model]), micro_batch_size=micro_batch_size(config, dims),
                         autocast_dtype=autocast, place=_then(place, replica_statistics(mesh, dims)),
                         shard_batch=shard_batch, sdpa_backend=config.train.sdpa_backend)


def _tensor_parallel_place(config: Config, dims: ParallelDims, mesh: DeviceMesh) -> Placement:
    if dims.tp == 1:
        return unplaced
    return tensor_parallel_context(mesh["tp"], config.parallel.sequence_parallel)


def _materialize(model: nn.Module, config: Config, device: torch.device) -> None:
    """Allocate a meta-device (possibly already parallelised) model on ``device`` with the single-process init."""
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, config.model, config.train.seed)


def _data_parallel(parts: list[nn.Module], dims: ParallelDims, mesh: DeviceMesh, autocast: torch.dtype | None,
                   parallel: ParallelConfig):
    """Shard ``parts`` for ZeRO-3 now (meta or materialised); return a factory that builds the strategy over
    the materialised parts. The cp ranks hold the same parameters: gradients are summed over dp x cp, in buckets of
    ``parallel.bucket_mb`` MiB (DDP, ZeRO-1/2); ZeRO-1/2 gather the updated parameters during the next forward when
    ``parallel.overlap_param_gather``."""
    bucket_bytes = max(1, int(parallel.bucket_mb * 2**20))
    if dims.zero_stage == 3 and dims.dp_cp > 1:
        for part in parts:
            experts = [layer.experts for layer in moe_layers(part)] if dims.ep > 1 else []
            apply_fsdp(part, mesh, dims, autocast, _blocks(part), expert_modules=experts)
        return lambda ms: FullyShardedDataParallel(named_parameters(ms), mesh, dims, ms)
    if dims.zero_stage in (1, 2) and dims.dp_cp > 1:
        return lambda ms: ZeroDataParallel(
            named_parameters(ms), mesh, dims, bucket_bytes,
            overlap_gather=(ms, [block for part in ms for block in _blocks(part)]) if parallel.overlap_param_gather
            else None)
    if dims.dp_cp > 1:
        return lambda ms: ReplicatedDataParallel(named_parameters(ms), mesh, dims, bucket_bytes)
    return lambda ms: DataParallel(named_parameters(ms), mesh, dims)


def _parallelize_pipeline(config: Config, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                          autocast: torch.dtype | None) -> ParallelModel:
    """Stages cut from the meta model, each tensor-parallel over ``tp`` (the first stage's embedding and the last
    stage's output projection split by vocabulary), activation-checkpointed and compiled before the schedule
    materialises and initialises it; data parallel around them."""
    def parallelize_stage(stage: nn.Module) -> None:
        if dims.tp > 1:
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=config.parallel.sequence_parallel)
        if dims.cp > 1:  # every stage holds the same tokens of each sequence
            apply_context_parallel(stage, mesh["cp"], load_balance=config.parallel.cp_load_balance)
        apply_activation_checkpointing(_stacks(stage), config.parallel.activation_checkpointing)
        _compile_blocks(stage, config)

    model = _numerics(build_model(config.model, materialize=False), config, device)
    # Each stage's cores sum their running statistics over the stage's dp replicas.
    place = _then(_tensor_parallel_place(config, dims, mesh), replica_statistics(mesh, dims))
    shard_batch = whole_batch
    routing_within = None
    if dims.cp > 1:  # the pipeline runs this cp rank's tokens of the batch
        layout = SequenceSlice(dims.cp, mesh["cp"].get_local_rank(), config.parallel.cp_load_balance)
        place, shard_batch = _then(place, lambda context: context.with_sequence(layout)), layout.shard_batch
        routing_within = ContextParallelTokens(mesh["cp"].get_group(), layout)
    if dims.ep > 1:  # every stage's MoE layers exchange tokens over this rank's ep group
        place = _then(place, expert_parallel_context(mesh["ep"], within=routing_within))
    elif routing_within is not None:
        place = _then(place, moe_routing_over(routing_within))
    if config.parallel.microbatches is None and dims.microbatches is not None:  # resolved against the batch
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                          microbatches=dims.microbatches))
    pipeline = PipelineSchedule(config, model, mesh["pp"], device=device, place=place,
                                parallelize_stage=parallelize_stage)
    if dims.ep > 1:  # the stages are materialised with the single-process init; keep this rank's experts
        for stage in pipeline.stages:
            if moe_layers(stage):
                apply_expert_parallel(stage, mesh["ep"])
    data_parallel = _data_parallel(pipeline.stages, dims, mesh, autocast, config.parallel)(pipeline.stages)
    return ParallelModel(pipeline.stages, data_parallel, micro_batch_size=0, autocast_dtype=autocast,
                         place=place, shard_batch=shard_batch, pipeline=pipeline,
                         sdpa_backend=config.train.sdpa_backend)
