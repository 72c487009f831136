"""The parallel layout: degrees, their validation, and the one named DeviceMesh every plan draws from.

World = pp x dp_replicate x dp_shard x cp x tp. Expert parallelism folds into data parallelism (GShard, Lepikhin et al.
2020): ``dp_shard = dp_expert x ep``, so the ranks of one ep group see different tokens and hold different experts,
and expert gradients are reduced over the ranks that hold the same experts (dp_replicate x dp_expert).

Mesh dimensions, outermost first: ``pp, dp_replicate, dp_expert, ep, cp, tp``; flattened views ``dp_shard``
(dp_expert x ep), ``dp`` (every data-parallel rank) and ``edp`` (dp_replicate x dp_expert: the ranks that share
experts). Context parallelism (``cp``, :mod:`xscale.parallel.context`) gives the ranks of one cp group the same
samples and a slice of each sequence's tokens: under it gradients and losses are summed over ``dp_cp``
(dp x cp) and ZeRO shards over ``dp_shard_cp`` (dp_shard x cp), two more flattened views; expert gradients are
summed over ``edp_cp`` (edp x cp) and ZeRO shards experts over ``dp_expert_cp`` (dp_expert x cp). Every other module
asks a :class:`ParallelDims` for sizes, ranks and groups, never the world directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_expert", "ep", "cp", "tp")
# Plans slice the flattened views (dp, dp_shard, edp) from the root mesh by name, which torch 2.11+ warns about.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one layout; ``world_size`` is their product (:func:`xscale.parallel.checks.resolve_dims` builds
    one from a config and refuses layouts that cannot run)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    zero_stage: int = 0
    cp: int = 1
    microbatches: int | None = None  # pipeline microbatches per step and dp rank, as resolve_dims resolved them

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

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The named mesh over the initialised default process group, with the flattened views."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialised process group")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"the layout needs {self.world_size} processes but the process group has "
                             f"{dist.get_world_size()}")
        shape = (self.pp, self.dp_replicate, self.dp_expert, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        mesh["dp_expert", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "dp_expert", "ep"]._flatten("dp")
        mesh["dp_replicate", "dp_expert"]._flatten("edp")
        if self.cp > 1:
            mesh["dp_expert", "ep", "cp"]._flatten("dp_shard_cp")
            mesh["dp_replicate", "dp_expert", "ep", "cp"]._flatten("dp_cp")
            mesh["dp_expert", "cp"]._flatten("dp_expert_cp")  # not adjacent (ep between): a strided view
            mesh["dp_replicate", "dp_expert", "cp"]._flatten("edp_cp")
        return mesh


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

