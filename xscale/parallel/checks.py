"""Refusals of a parallel layout, before any process group exists: degrees against the world size, the model
and the batch, each dimension's own checks (:mod:`~xscale.parallel.tensor`, :mod:`~xscale.parallel.context`,
:mod:`~xscale.parallel.pipeline`). Every message says what to change."""

from __future__ import annotations

import dataclasses

import torch

from xscale.config.schema import Config, ConfigError
from xscale.models.stacks import stack_variant
from xscale.parallel.context import check_context_parallel
from xscale.parallel.dims import ParallelDims
from xscale.parallel.pipeline import check_pipeline, resolve_microbatches
from xscale.parallel.tensor import check_tensor_parallel


def resolve_dims(config: Config, world_size: int) -> ParallelDims:
    """Resolve ``dp_shard=-1`` against ``world_size`` and an unset ``parallel.microbatches``
    (:func:`~xscale.parallel.pipeline.resolve_microbatches`, in ``ParallelDims.microbatches``), and refuse any
    layout that cannot run. ``config`` is not changed (:func:`resolve_layout` gives the resolved copy)."""
    parallel = config.parallel
    for name in ("dp_replicate", "tp", "pp", "ep", "cp", "microbatches", "pp_stages_per_rank"):
        value = getattr(parallel, name)
        if value is not None and value < 1:  # microbatches=None: auto, resolved below
            raise ConfigError(f"parallel.{name} must be >= 1, got {value}")
    if parallel.dp_shard == 0 or parallel.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard must be >= 1, or -1 for 'what the world size leaves', got "
                          f"{parallel.dp_shard}")
    fixed = parallel.pp * parallel.dp_replicate * parallel.cp * parallel.tp
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by pp x dp_replicate x cp x tp = {parallel.pp} x "
                f"{parallel.dp_replicate} x {parallel.cp} x {parallel.tp} = {fixed}; launch a multiple of "
                f"{fixed} processes "
                f"or change the layout")
        dp_shard = world_size // fixed
    dims = ParallelDims(pp=parallel.pp, dp_replicate=parallel.dp_replicate, dp_shard=dp_shard, tp=parallel.tp,
                        ep=parallel.ep, zero_stage=parallel.zero_stage, cp=parallel.cp)
    if dims.world_size != world_size:
        raise ConfigError(
            f"the layout needs pp x dp_replicate x dp_shard x cp x tp = {parallel.pp} x "
            f"{parallel.dp_replicate} x {dp_shard} x {parallel.cp} x {parallel.tp} = {dims.world_size} "
            f"processes but {world_size} were launched; "
            f"launch {dims.world_size} (torchrun --nproc-per-node {dims.world_size}) or set parallel.dp_shard=-1")
    check_layout(config, dims)  # the pipeline checks resolve an unset microbatch count the same way
    # The one place an unset parallel.microbatches becomes a count.
    return dataclasses.replace(dims, microbatches=resolve_microbatches(config, dims.dp))


def resolve_layout(config: Config, world_size: int) -> tuple[ParallelDims, Config]:
    """:func:`resolve_dims`, and a copy of ``config`` whose ``parallel.microbatches`` is the resolved count (what
    every later reader sees: the pipeline, the step, inspect); ``config`` itself is not changed."""
    dims = resolve_dims(config, world_size)
    resolved = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                        microbatches=dims.microbatches))
    return dims, resolved

def check_layout(config: Config, dims: ParallelDims) -> None:
    """Every check that needs only the degrees and the config (no process group)."""
    parallel, model = config.parallel, config.model
    if parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage} must be 0 (DDP), 1 (optimizer state "
                          f"sharded), 2 (+ gradients) or 3 (+ parameters, FSDP2)")
    if dims.ep > 1:
        if model.moe.num_experts == 0:
            raise ConfigError(f"parallel.ep={dims.ep} needs an MoE model; set model.moe.num_experts or "
                              f"parallel.ep=1")
        if dims.dp_shard % dims.ep:
            raise ConfigError(
                f"parallel.ep={dims.ep} must divide the sharded data-parallel degree dp_shard={dims.dp_shard} "
                f"(experts are spread over data-parallel ranks); pick ep from "
                f"{[d for d in range(1, dims.dp_shard + 1) if dims.dp_shard % d == 0]}")
    if config.train.precision == "fp8" and dims.tp > 1:
        raise ConfigError(f"train.precision=fp8 with parallel.tp={dims.tp}: the tensor-parallel plan does not yet "
                          "shard torchao's Float8Linear (its float8 tensor-parallel styles); use tp=1 with fp8 "
                          "(data, ZeRO, pipeline, expert and context parallelism compose) or precision=bf16")
    if parallel.sequence_parallel and dims.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards norms and dropout "
                          "over the tensor-parallel ranks)")
    if parallel.sequence_parallel and config.train.seq_len % dims.tp:
        raise ConfigError(f"sequence parallelism splits each sequence over tp={dims.tp} ranks; make "
                          f"train.seq_len={config.train.seq_len} a multiple of {dims.tp}")
    _check_stack_variant(config, dims)
    if dims.cp > 1:
        check_context_parallel(config, dims)
    if dims.tp > 1:
        check_tensor_parallel(config.model, dims.tp)
    if dims.pp > 1:
        check_pipeline(config, dims.dp)
    _check_batch(config, dims)
    if parallel.backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("parallel.backend=nccl needs CUDA GPUs; on CPU use parallel.backend=auto (gloo)")

# The layout settings a stack variant's traits may refuse (:class:`~xscale.models.traits.StackTraits`): trait ->
# (the parallel.* key, whether the layout sets it, the value that lifts the refusal).
STACK_LAYOUT_SETTINGS = {
    "pp": ("pp", lambda parallel, dims: dims.pp > 1, "1"),
    "tp": ("tp", lambda parallel, dims: dims.tp > 1, "1"),
    "sequence_parallel": ("sequence_parallel", lambda parallel, dims: parallel.sequence_parallel, "false"),
    "cp": ("cp", lambda parallel, dims: dims.cp > 1, "1"),
    "zero3": ("zero_stage", lambda parallel, dims: parallel.zero_stage == 3, "2"),
    "activation_checkpointing": ("activation_checkpointing",
                                 lambda parallel, dims: parallel.activation_checkpointing != "none", "none"),
}


def _check_stack_variant(config: Config, dims: ParallelDims) -> None:
    """The layouts the stack variant (``model.stack``) refuses by its declared traits, with its reasons; under
    context parallelism, a sequence length its pooling keeps in whole, even chunks."""
    parallel, model = config.parallel, config.model
    variant, options = stack_variant(model)
    divisor = variant.sequence_divisor(model, options)
    if dims.cp > 1 and divisor > 1:
        chunks = 2 * dims.cp if parallel.cp_load_balance else dims.cp
        if config.train.seq_len % (chunks * divisor):
            raise ConfigError(f"model.stack={model.stack.kind} divides the sequence by {divisor}, and every chunk "
                              f"of the {chunks} context-parallel chunks must stay whole and even: make "
                              f"train.seq_len={config.train.seq_len} a multiple of {chunks * divisor}")
    for trait, refusal in variant.stack_traits.refusals().items():
        name, applies, fix = STACK_LAYOUT_SETTINGS[trait]
        if applies(parallel, dims):
            value = str(getattr(parallel, name)).lower()
            raise ConfigError(f"parallel.{name}={value} is refused with model.stack={model.stack.kind}: "
                              f"{refusal.reason}; set parallel.{name}={fix} or model.stack=plain")


def _check_batch(config: Config, dims: ParallelDims) -> None:
    train = config.train
    if train.global_batch_size % dims.dp:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} does not split over {dims.dp} data-parallel "
            f"ranks; make it a multiple of {dims.dp}")
    local = train.global_batch_size // dims.dp
    if dims.pp == 1 and train.micro_batch_size is not None:
        if train.micro_batch_size <= 0 or local % train.micro_batch_size:
            raise ConfigError(
                f"train.micro_batch_size={train.micro_batch_size} must divide the per-rank batch {local} "
                f"(global {train.global_batch_size} / dp {dims.dp})")
