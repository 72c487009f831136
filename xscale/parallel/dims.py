"""The parallel layout: degrees, their validation, and the one named DeviceMesh every plan draws from.

World = pp x dp_replicate x dp_shard x cp x tp. Expert parallelism folds into data parallelism (GShard, Lepikhin et al.
2020): ``dp_shard = dp_expert x ep``, so the ranks of one ep group see different tokens and hold different experts,
and expert gradients are reduced over the ranks that hold the same experts (dp_replicate x dp_expert).

Mesh dimensions, outermost first: ``pp, dp_replicate, dp_expert, ep, cp, tp``; flattened views ``dp_shard``
(dp_expert x ep), ``dp`` (every data-parallel rank) and ``edp`` (dp_replicate x dp_expert: the ranks that share
experts). Context parallelism (``cp``, :mod:`xscale.parallel.context`) gives the ranks of one cp group the same
samples and a slice of each sequence's tokens: under it gradients and losses are summed over ``dp_cp``
(dp x cp) and ZeRO shards over ``dp_shard_cp`` (dp_shard x cp), two more flattened views. Every other module
asks a :class:`ParallelDims` for sizes, ranks and groups, never the world directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from xscale.config import Config, ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_expert", "ep", "cp", "tp")
# Plans slice the flattened views (dp, dp_shard, edp) from the root mesh by name, which torch 2.11+ warns about.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one layout; ``world_size`` is their product (checked by :meth:`from_config`)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    zero_stage: int = 0
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_expert(self) -> int:
        return self.dp_shard // self.ep

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (their expert gradients are reduced together)."""
        return self.dp // self.ep

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters that see different tokens: gradients are summed over them."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        return self.zero_stage == 3 and self.dp_cp > 1

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                 if getattr(self, name) > 1]
        zero = f", ZeRO-{self.zero_stage}" if self.zero_stage and self.dp_cp > 1 else ""
        return f"world {self.world_size}: " + (" x ".join(parts) if parts else "single process") + zero

    @classmethod
    def from_config(cls, config: Config, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` against ``world_size`` and an unset ``parallel.microbatches`` (written back into
        ``config``: :func:`~xscale.parallel.pipeline.resolve_microbatches`), and refuse any layout that cannot run."""
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
        dims = cls(pp=parallel.pp, dp_replicate=parallel.dp_replicate, dp_shard=dp_shard, tp=parallel.tp,
                   ep=parallel.ep, zero_stage=parallel.zero_stage, cp=parallel.cp)
        if dims.world_size != world_size:
            raise ConfigError(
                f"the layout needs pp x dp_replicate x dp_shard x cp x tp = {parallel.pp} x "
                f"{parallel.dp_replicate} x {dp_shard} x {parallel.cp} x {parallel.tp} = {dims.world_size} "
                f"processes but {world_size} were launched; "
                f"launch {dims.world_size} (torchrun --nproc-per-node {dims.world_size}) or set parallel.dp_shard=-1")
        dims.validate(config)  # the pipeline checks resolve an unset microbatch count the same way
        from xscale.parallel.pipeline import resolve_microbatches

        # The one place an unset parallel.microbatches becomes a count; every later reader sees the count.
        parallel.microbatches = resolve_microbatches(config, dims.dp)
        return dims

    def validate(self, config: Config) -> None:
        """Every check that needs only the degrees and the config (no process group)."""
        parallel, model = config.parallel, config.model
        if parallel.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={parallel.zero_stage} must be 0 (DDP), 1 (optimizer state "
                              f"sharded), 2 (+ gradients) or 3 (+ parameters, FSDP2)")
        if self.ep > 1:
            if model.moe.num_experts == 0:
                raise ConfigError(f"parallel.ep={self.ep} needs an MoE model; set model.moe.num_experts or "
                                  f"parallel.ep=1")
            if self.dp_shard % self.ep:
                raise ConfigError(
                    f"parallel.ep={self.ep} must divide the sharded data-parallel degree dp_shard={self.dp_shard} "
                    f"(experts are spread over data-parallel ranks); pick ep from "
                    f"{[d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]}")
        if parallel.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards norms and dropout "
                              "over the tensor-parallel ranks)")
        if parallel.sequence_parallel and config.train.seq_len % self.tp:
            raise ConfigError(f"sequence parallelism splits each sequence over tp={self.tp} ranks; make "
                              f"train.seq_len={config.train.seq_len} a multiple of {self.tp}")
        if self.cp > 1:
            check_context_parallel_layout(config, self)
        if self.tp > 1:
            check_tensor_parallel(config, self.tp)
        if self.pp > 1:
            check_pipeline_layout(config, self)
        self._validate_batch(config)
        if parallel.backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("parallel.backend=nccl needs CUDA GPUs; on CPU use parallel.backend=auto (gloo)")

    def _validate_batch(self, config: Config) -> None:
        train = config.train
        if train.global_batch_size % self.dp:
            raise ConfigError(
                f"train.global_batch_size={train.global_batch_size} does not split over {self.dp} data-parallel "
                f"ranks; make it a multiple of {self.dp}")
        local = train.global_batch_size // self.dp
        if self.pp == 1 and train.micro_batch_size is not None:
            if train.micro_batch_size <= 0 or local % train.micro_batch_size:
                raise ConfigError(
                    f"train.micro_batch_size={train.micro_batch_size} must divide the per-rank batch {local} "
                    f"(global {train.global_batch_size} / dp {self.dp})")

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over the initialised default process group, with the flattened views."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialised process group")
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"the layout needs {self.world_size} processes but the process group has "
                              f"{dist.get_world_size()}")
        shape = (self.pp, self.dp_replicate, self.dp_expert, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        mesh["dp_expert", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "dp_expert", "ep"]._flatten("dp")
        mesh["dp_replicate", "dp_expert"]._flatten("edp")
        if self.cp > 1:
            mesh["dp_expert", "ep", "cp"]._flatten("dp_shard_cp")
            mesh["dp_replicate", "dp_expert", "ep", "cp"]._flatten("dp_cp")
        return mesh


def check_tensor_parallel(config: Config, tp: int) -> None:
    """Tensor-parallel checks: heads, kv heads, FFN width and vocabulary divisible by tp, splittable attention."""
    from xscale.parallel.tensor import check_tensor_parallel as check_plan

    check_plan(config.model, tp)


def check_context_parallel_layout(config: Config, dims: ParallelDims) -> None:
    """Context-parallel checks (refused layouts, model kinds and sequence lengths)."""
    from xscale.parallel.context import check_context_parallel

    check_context_parallel(config, dims)


def check_pipeline_layout(config: Config, dims: ParallelDims) -> None:
    """Pipeline checks (stages vs layers, schedule vs microbatches, refused model kinds)."""
    from xscale.parallel.pipeline import check_pipeline

    check_pipeline(config, dims.dp)


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Coordinates of global ``rank`` on the mesh (row-major over MESH_DIMS), for plans printed without a mesh."""
    shape = (dims.pp, dims.dp_replicate, dims.dp_expert, dims.ep, dims.cp, dims.tp)
    coordinates = {}
    for name, size in zip(reversed(MESH_DIMS), reversed(shape)):
        coordinates[name] = rank % size
        rank //= size
    coordinates["dp_shard"] = coordinates["dp_expert"] * dims.ep + coordinates["ep"]
    coordinates["dp"] = coordinates["dp_replicate"] * dims.dp_shard + coordinates["dp_shard"]
    return coordinates

