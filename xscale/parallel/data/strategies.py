"""Data parallelism: DDP-style gradient all-reduce, ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020).

The loss every rank back-propagates is its share of the global-batch mean (token sum / global token count), so
the global gradient is the SUM of the ranks' gradients. Expert parameters (under expert parallelism) are summed
only over the ranks that hold the same experts (``edp``), every other parameter over all data-parallel ranks.

ZeRO-1/2 partition each parameter's flattened local tensor into equal chunks over the sharding group (``dp_shard``,
``dp_shard x cp`` under context parallelism; ``dp_expert`` for experts) and replicate over ``dp_replicate`` (HSDP). The optimizer owns only this rank's chunk:
its "parameter" is a view into the model parameter's storage, so fp32 training keeps no extra master copy and the
per-rank bytes are the paper's: params 4Psi, grads 4Psi (ZeRO-1) or 4Psi/N (ZeRO-2), Adam moments 8Psi/N.
Both stages reduce-scatter the gradients (an all-reduce would send the same bytes and then the half no one reads):
stage 1 keeps the whole-gradient buffers from step to step, stage 2 frees them once sent. Both start their buckets
during the last microbatch's backward (:mod:`xscale.parallel.data.buckets`).
After the step every rank all-gathers the updated chunks, a bucket at a time (:mod:`xscale.parallel.data.gather`).
ZeRO-3 is FSDP2 (:mod:`xscale.parallel.data.fsdp`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from xscale.parallel.collectives import all_gather_flat
from xscale.parallel.data.buckets import BucketGroups, GradientBuckets
from xscale.parallel.data.gather import ChunkGather, GatherSlot
from xscale.parallel.data.gather_hooks import install_gather_waits
from xscale.parallel.data.grad_norm import GradientPiece
from xscale.parallel.dims import ParallelDims

BUCKET_BYTES = 32 * 2**20


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (the local shard of a DTensor)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_expert_parameter(name: str) -> bool:
    return ".experts." in f".{name}"


def sharded_mesh_size(tensor: torch.Tensor) -> int:
    """How many different pieces of ``tensor`` its DTensor mesh holds (1 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 1
    size = 1
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard | _StridedShard):  # FSDP2 over a tensor-parallel Shard(0) uses _StridedShard
            size *= tensor.device_mesh.size(dim)
    return size


def start_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], torch.Tensor]:
    """Start an asynchronous all-reduce (sum) of a detached copy of ``value`` over ``group`` (None: nothing to sum);
    return the call that waits for it and gives the sum. Every rank of ``group`` must start it in the same order
    relative to its other collectives on that group, as with any collective."""
    total = value.detach().clone()
    if group is None:
        return lambda: total
    work = dist.all_reduce(total, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return total
    return wait


@dataclass
class NamedParameter:
    name: str  # canonical (single-process) name
    param: nn.Parameter


class DataParallel:
    """Strategy for one layout's data-parallel dimension; this base class is the single-replica case.

    The trainer's step calls :meth:`global_token_count` and :meth:`reduce_loss` each step, :meth:`after_backward` once
    after the last microbatch, :meth:`optimizer_step` instead of ``optimizer.step()``, and
    :meth:`gradient_pieces` for the global norm.
    """

    def __init__(self, parameters: list[NamedParameter], mesh: DeviceMesh | None = None,
                 dims: ParallelDims | None = None) -> None:
        """``parameters``: this rank's, under single-process names; ``mesh`` and ``dims``: the layout (None: one
        replica of a model this rank holds whole, or a pipeline's stages without data parallelism)."""
        self.parameters = parameters
        self.mesh = mesh
        self.stage_replicas = 1 if dims is None else dims.world_size // dims.pp  # ranks of one pipeline stage
        self.expert_parallel = 1 if dims is None else dims.ep
        # Under context parallelism the ranks of a cp group hold the same samples (tokens are counted over dp) but
        # different tokens of them: losses and gradients are summed over dp x cp, ZeRO shards over dp_shard x cp.
        context_parallel = dims is not None and dims.cp > 1
        self.reduce_dim = "dp_cp" if context_parallel else "dp"
        self.shard_dim = "dp_shard_cp" if context_parallel else "dp_shard"
        # Expert gradients: over the ranks holding the same experts (edp), and the cp ranks of each.
        self.expert_reduce_dim = "edp_cp" if context_parallel else "edp"
        self.expert_shard_dim = "dp_expert_cp" if context_parallel else "dp_expert"

    # Whether the forward gathers parameters with the other ranks (ZeRO-3), so that every rank must run the same
    # blocks (no rank may stop a forward early).
    gathers_in_forward = False
    # Whether every rank ends the backward with every gradient whole and equal (DDP over all ranks, nothing sharded):
    # the global gradient norm is then the local one, with no collective.
    gradients_whole_on_every_rank = False

    # The groups and sizes a step reads, taken from the mesh once: slicing a DeviceMesh by name costs ~0.2-0.5 ms.
    @functools.cached_property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.mesh is not None and self.mesh["dp"].size() > 1 else None

    @functools.cached_property
    def reduce_group(self) -> dist.ProcessGroup | None:
        """The ranks whose losses and (non-expert) gradients are summed: dp, or dp x cp."""
        if self.mesh is None or self.mesh[self.reduce_dim].size() == 1:
            return None
        return self.mesh[self.reduce_dim].get_group()

    @functools.cached_property
    def replicas(self) -> int:
        """Ranks whose losses are summed (dp, or dp x cp): each runs every microbatch of its share of the batch."""
        return self.mesh[self.reduce_dim].size() if self.mesh is not None else 1

    @functools.cached_property
    def routing_groups(self) -> int:
        """MoE routing groups one microbatch forms: data-parallel ranks / ep (an ep group routes together)."""
        dp = self.mesh["dp"].size() if self.mesh is not None else 1
        return dp // self.expert_parallel

    @functools.cached_property
    def _routing_group_sum(self) -> dist.ProcessGroup | None:
        return self.mesh["edp"].get_group() if self.mesh is not None and self.mesh["edp"].size() > 1 else None

    def sum_over_routing_groups(self, value: torch.Tensor) -> None:
        """Sum ``value`` in place over the ranks that route different MoE groups (``edp``: one per ep group)."""
        if self._routing_group_sum is not None:
            dist.all_reduce(value, group=self._routing_group_sum)

    def start_token_count(self, local: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing ``local`` (a count) over the data-parallel ranks; the call returned waits and gives the
        sum, so a step can start its first forward while the count travels (:func:`start_sum`)."""
        return start_sum(local, self.dp_group)

    def start_loss_reduction(self, local: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing this rank's loss over dp (x cp); the call returned waits and gives the sum."""
        return start_sum(local, self.reduce_group)

    def global_token_count(self, local: torch.Tensor) -> torch.Tensor:
        return self.start_token_count(local)()

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        return self.start_loss_reduction(local)()

    def after_backward(self) -> None:
        """Make every gradient the global one (nothing to do for one replica)."""

    def settle(self) -> None:
        """Finish any update of the parameters still in flight, before they are read outside a forward (checkpoint,
        evaluation, export); nothing here."""

    def requires_gradient_sync(self, enabled: bool) -> None:
        """Set before each microbatch's backward (FSDP reduces only on the last)."""

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory this strategy holds from step to step (none here)."""
        return []

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return [entry.param for entry in self.parameters]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _replicas(self, name: str, grad: torch.Tensor, shard_size: int = 1) -> int:
        """Ranks of this pipeline stage holding the same values as this rank's piece of ``grad``."""
        distinct = sharded_mesh_size(grad) * shard_size
        if is_expert_parameter(name):
            distinct *= self.expert_parallel  # the ep mesh dimension is never part of a parameter's DTensor mesh
        return max(1, self.stage_replicas // distinct)

    def gradient_pieces(self, uncounted: Collection[int] = ()) -> list[GradientPiece]:
        """This rank's gradient pieces with their replica counts (``uncounted``: ids of parameters clipped but not
        counted in the norm, e.g. the pipeline's copies of a shared parameter, one of which is counted)."""
        pieces = []
        for entry in self.parameters:
            grad = entry.param.grad
            if grad is not None:
                pieces.append(GradientPiece(local_tensor(grad), self._replicas(entry.name, grad),
                                            counted=id(entry.param) not in uncounted))
        return pieces

    # checkpoint: None means "use torch.distributed.checkpoint.state_dict as is"
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        return None

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        raise NotImplementedError


class ReplicatedDataParallel(DataParallel):
    """DDP semantics (ZeRO-0): whole parameters and optimizer state on every rank, gradients all-reduced in buckets
    that start during the last microbatch's backward (:mod:`xscale.parallel.data.buckets`)."""

    keeps_gradient_buffers = True

    def __init__(self, parameters: list[NamedParameter], mesh: DeviceMesh, dims: ParallelDims,
                 bucket_bytes: int = BUCKET_BYTES, on_bucket_start: Callable[[int], None] | None = None) -> None:
        """``bucket_bytes``: the most gradient bytes one collective carries; ``on_bucket_start``: called with each
        bucket's index as its collective starts (tests record the order)."""
        super().__init__(parameters, mesh, dims)
        self.buckets = GradientBuckets(self._bucket_parameters(), bucket_bytes, self.keeps_gradient_buffers,
                                       on_bucket_start)
        self.gradients_whole_on_every_rank = dims.pp == 1 and self.expert_parallel == 1 and all(
            sharded_mesh_size(entry.param) == 1 for entry in parameters)

    def _bucket_parameters(self) -> list[tuple[nn.Parameter, BucketGroups]]:
        """Each trained parameter with the group its gradient is summed over (none if that group is one rank)."""
        bucketed = []
        for entry in self.parameters:
            expert = is_expert_parameter(entry.name) and self.expert_parallel > 1
            dimension = self.expert_reduce_dim if expert else self.reduce_dim
            if entry.param.requires_grad and self.mesh[dimension].size() > 1:
                bucketed.append((entry.param, BucketGroups(None, 1, self.mesh[dimension].get_group(), dimension)))
        return bucketed

    def requires_gradient_sync(self, enabled: bool) -> None:
        self.buckets.sync = enabled

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [bucket.buffer for bucket in self.buckets.buckets if bucket.buffer is not None]

    def after_backward(self) -> None:
        self.buckets.finish()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.buckets.release()


@dataclass
class _Partition:
    """One parameter's chunk on this rank: elements [start, stop) of its flattened local tensor."""

    entry: NamedParameter
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    shard_size: int
    chunk: int
    start: int
    stop: int
    shard: nn.Parameter  # view of the model parameter's storage

    @property
    def numel(self) -> int:
        return local_tensor(self.entry.param).numel()


class ZeroDataParallel(ReplicatedDataParallel):
    """ZeRO-1 (optimizer state partitioned) or ZeRO-2 (+ gradients partitioned) over ``dp_shard``."""

    def __init__(self, parameters: list[NamedParameter], mesh: DeviceMesh, dims: ParallelDims,
                 bucket_bytes: int = BUCKET_BYTES, on_bucket_start: Callable[[int], None] | None = None,
                 overlap_gather: tuple[list[nn.Module], list[nn.Module]] | None = None) -> None:
        """``overlap_gather``: (the parts, their blocks) to leave the parameter all-gather in flight after each
        optimizer step, each module of the next forward waiting for its own buckets (:mod:`gather_hooks`); None:
        the step gathers everything before it returns."""
        stage = dims.zero_stage
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, got {stage}")
        self.stage = stage
        self.keeps_gradient_buffers = stage == 1
        self.partitions: list[_Partition] = []
        super().__init__(parameters, mesh, dims, bucket_bytes, on_bucket_start)
        self.gradients_whole_on_every_rank = False  # the norm is taken over this rank's chunks
        self.partition_of = {id(part.entry.param): part for part in self.partitions}
        slots = {id(part.entry.param): GatherSlot(local_tensor(part.entry.param).detach().view(-1),
                                                  part.shard.detach(), part.chunk, 0)
                 for part in self.partitions if part.shard_group is not None}
        self.gather = ChunkGather([(slots[id(part.entry.param)], part.shard_group, part.shard_size)
                                   for part in self.partitions if part.shard_group is not None], bucket_bytes)
        self.overlap_gather = overlap_gather is not None
        if overlap_gather is not None:
            bucket_index = self.gather.bucket_index()
            install_gather_waits(*overlap_gather, {key: bucket_index[id(slot)] for key, slot in slots.items()},
                                 self.gather.wait_through, self.gather.finish)

    def _bucket_parameters(self) -> list[tuple[nn.Parameter, BucketGroups]]:
        """Gradients reduce-scattered over the sharding group, then all-reduced over ``dp_replicate``."""
        self.partitions = [self._partition(entry) for entry in self.parameters]
        return [(part.entry.param, BucketGroups(part.shard_group, part.shard_size, part.replicate_group,
                                                is_expert_parameter(part.entry.name)))
                for part in self.partitions if part.entry.param.requires_grad]

    def _groups(self, name: str) -> tuple[DeviceMesh, DeviceMesh]:
        expert = is_expert_parameter(name) and self.expert_parallel > 1
        return self.mesh[self.expert_shard_dim if expert else self.shard_dim], self.mesh["dp_replicate"]

    def _partition(self, entry: NamedParameter) -> _Partition:
        shard_mesh, replicate_mesh = self._groups(entry.name)
        size, rank = shard_mesh.size(), shard_mesh.get_local_rank()
        flat = local_tensor(entry.param).detach().view(-1)
        chunk = math.ceil(flat.numel() / size)
        start, stop = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
        shard = nn.Parameter(flat[start:stop], requires_grad=entry.param.requires_grad)
        return _Partition(entry, shard_mesh.get_group() if size > 1 else None,
                          replicate_mesh.get_group() if replicate_mesh.size() > 1 else None,
                          size, chunk, start, stop, shard)

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return [part.shard for part in self.partitions]

    @torch.no_grad()
    def after_backward(self) -> None:
        outputs = self.buckets.finish()
        for bucket, reduced in zip(self.buckets.buckets, outputs):  # this rank's reduced chunks
            for slot in bucket.slots:
                part = self.partition_of[id(slot.param)]
                part.shard.grad = reduced[slot.column:slot.column + part.stop - part.start]

    def gradient_pieces(self, uncounted: Collection[int] = ()) -> list[GradientPiece]:
        pieces = []
        for part in self.partitions:
            if part.shard.grad is not None:
                replicas = self._replicas(part.entry.name, part.entry.param, part.shard_size)
                pieces.append(GradientPiece(part.shard.grad, replicas, counted=id(part.entry.param) not in uncounted))
        return pieces

    @torch.no_grad()
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.gather.finish()  # buckets no forward waited for (parameters the last step did not use)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for part in self.partitions:
            part.entry.param.grad = None
        if self.overlap_gather:
            self.gather.start()
        else:
            self.gather.gather()

    def settle(self) -> None:
        self.gather.finish()

    @staticmethod
    def _all_gather(part: _Partition, full: torch.Tensor, chunk: torch.Tensor) -> None:
        """Fill ``full`` (flat, numel elements) with every rank's ``chunk`` (padded to equal sizes on the wire)."""
        padded = chunk.new_zeros(part.chunk)
        padded[: chunk.numel()] = chunk
        gathered = chunk.new_empty(part.chunk * part.shard_size)
        all_gather_flat(gathered, padded, group=part.shard_group)
        full.copy_(gathered[: part.numel])

    # ------------------------------------------------------------------ checkpoint
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The single-process AdamW state in DCP's flattened layout (``state.<name>.<key>``,
        ``param_groups.<name>.<key>``), each moment gathered to the parameter's local shape and given the
        parameter's DTensor placements, so DCP reshards it to any layout."""
        self.settle()
        flat: dict[str, Any] = {}
        for part in self.partitions:
            shard_state = optimizer.state.get(part.shard, {})
            param, name = part.entry.param, part.entry.name
            flat[f"state.{name}.step"] = shard_state.get("step", torch.zeros((), dtype=torch.float32)).clone()
            for key in ("exp_avg", "exp_avg_sq"):
                chunk = shard_state.get(key, torch.zeros_like(part.shard))
                full = torch.empty_like(local_tensor(param)).view(-1)
                if part.shard_group is None:
                    full.copy_(chunk)
                else:
                    self._all_gather(part, full, chunk.detach())
                full = full.view_as(local_tensor(param))
                if isinstance(param, DTensor):
                    full = DTensor.from_local(full, param.device_mesh, param.placements, shape=param.shape,
                                              stride=param.stride())
                flat[f"state.{name}.{key}"] = full
        names = {id(part.shard): part.entry.name for part in self.partitions}
        for group in optimizer.param_groups:
            for shard in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        flat[f"param_groups.{names[id(shard)]}.{key}"] = value
        return flat

    @torch.no_grad()
    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.settle()
        names = {id(part.shard): part.entry.name for part in self.partitions}
        for part in self.partitions:
            name = part.entry.name
            # the step count where the update reads it: the fused kernel wants it on the parameter's device
            restored = {"step": state[f"state.{name}.step"].detach().float().to(part.shard.device, copy=True)}
            for key in ("exp_avg", "exp_avg_sq"):
                full = local_tensor(state[f"state.{name}.{key}"]).reshape(-1)
                restored[key] = full[part.start:part.stop].clone()
            optimizer.state[part.shard] = restored
        for group in optimizer.param_groups:
            if not group["params"]:
                continue
            prefix = f"param_groups.{names[id(group['params'][0])]}."
            for key, value in state.items():
                if key.startswith(prefix):
                    group[key[len(prefix):]] = value
