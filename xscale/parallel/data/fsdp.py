"""ZeRO-3: parameters, gradients and optimizer state sharded with FSDP2 ``fully_shard`` (HSDP over two dims).

Each Transformer block is one FSDP unit (all-gathered just before it runs, freed after); the root unit holds the
embedding, final norms and LM head and stays unsharded between forward and backward because the loss reads the
output projection right after the forward. Gradients are reduce-scattered as sums (the loss is already the
global-batch mean), in fp32 when the parameters run in bf16 (fp32 master weights).

Under pipeline parallelism each stage is a root, and its blocks too stay unsharded from forward to backward: the
schedule all-gathers a stage once before its first microbatch and frees it after its last (torchtitan's default
for pp), instead of once per microbatch, and zero-bubble's split backward needs it: it lists the stage's
parameters before the autograd call that would unshard them, so a resharded block's weight gradient is lost.

On CPU over gloo every unit's all-gather and reduce-scatter go through :mod:`xscale.parallel.collectives`' direct
transfers (FSDP2's custom-collective hooks), which are faster there than gloo's own; FSDP2 runs its
reduce-scatter in the backward's path and waits on it, so that time is the step's. ``XSCALE_GLOO_DIRECT=0`` keeps
torch's. FSDP2 overlaps a block's all-gather with the previous block's compute through CUDA streams; a CPU has none,
so there each block asks for the next block's all-gather, asynchronous, when its forward starts (and for the
previous block's when its backward starts): the same two blocks gathered at once as FSDP2's prefetch on a GPU.
Against FSDP2 with its defaults on the same model and batches (`xscale bench parallel`, 2 gloo ranks of a 2-core
machine): 0.97x with neither, 1.03-1.04x with the direct transfers, 1.07-1.10x with both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

try:  # FSDP2's custom-collective interfaces (torch >= 2.9); without them FSDP2 keeps its own
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
except ImportError:  # pragma: no cover - older torch
    AllGather = ReduceScatter = DefaultAllocMixin = object

from xscale.parallel.collectives import GLOO_DIRECT, all_gather_flat, reduce_scatter_flat
from xscale.parallel.data.strategies import DataParallel, NamedParameter
from xscale.parallel.dims import ParallelDims


def data_parallel_mesh(mesh: DeviceMesh, dims: ParallelDims, expert: bool = False) -> DeviceMesh:
    """The mesh FSDP shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard (dp_expert for experts;
    x cp under context parallelism, whose ranks hold the same parameters)."""
    if expert:
        shard = "dp_expert_cp" if dims.cp > 1 else "dp_expert"
    else:
        shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


class _FlatAllGather(DefaultAllocMixin, AllGather):
    """FSDP2's all-gather through :func:`xscale.parallel.collectives.all_gather_flat`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)


class _FlatReduceScatter(DefaultAllocMixin, ReduceScatter):
    """FSDP2's reduce-scatter (a sum: :func:`apply_fsdp` forces sums) through
    :func:`xscale.parallel.collectives.reduce_scatter_flat`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"xscale's FSDP reduce-scatter sums gradients; FSDP2 asked for {op}")
        return reduce_scatter_flat(output_tensor, input_tensor, group=group, async_op=async_op)


def _use_direct_collectives(unit: nn.Module) -> None:
    """The unit's collectives through the flat ones, the direct transfers on gloo (module docstring)."""
    if AllGather is not object and GLOO_DIRECT:
        unit.set_custom_all_gather(_FlatAllGather())
        unit.set_custom_reduce_scatter(_FlatReduceScatter())


def _prefetch_on_cpu(blocks: list[nn.Module]) -> None:
    """Each block's all-gather started while its neighbour computes: the next block's in the forward, the previous
    one's in the backward (module docstring)."""
    for index, block in enumerate(blocks):
        group = getattr(block._get_fsdp_state(), "_fsdp_param_group", None)
        if hasattr(group, "unshard_async_op"):  # FSDP2's switch for asynchronous prefetch (no public setter)
            group.unshard_async_op = True
        if index + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[index + 1]])
        if index > 0:
            block.set_modules_to_backward_prefetch([blocks[index - 1]])


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, param_dtype: torch.dtype | None,
               blocks: list[nn.Module], expert_modules: list[nn.Module] = ()) -> None:
    """Shard ``model`` in place: each of ``blocks`` one unit (experts their own unit over ``edp``, x cp), then the root."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    dense_mesh = data_parallel_mesh(mesh, dims)
    reshard_blocks = dims.pp == 1  # a pipeline stage stays gathered over its microbatches (module docstring)
    for experts in expert_modules:
        fully_shard(experts, mesh=data_parallel_mesh(mesh, dims, expert=True), mp_policy=policy,
                    reshard_after_forward=reshard_blocks)
    for index, block in enumerate(blocks):
        # the last block's backward comes right after the forward: resharding it would only gather it again at once
        last = index == len(blocks) - 1
        fully_shard(block, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard_blocks and not last)
    fully_shard(model, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=False)
    on_cpu = dense_mesh.device_type == "cpu"
    for unit in [*expert_modules, *blocks, model]:
        unit.set_gradient_divide_factor(1.0)  # sums: the loss is already the global-batch mean
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
        if on_cpu:
            _use_direct_collectives(unit)
    if reshard_blocks and on_cpu:
        _prefetch_on_cpu(blocks)


class FullyShardedDataParallel(DataParallel):
    """The strategy object for ZeRO-3: FSDP2 reduces gradients itself during backward."""

    gathers_in_forward = True

    def __init__(self, parameters: list[NamedParameter], mesh: DeviceMesh, dims: ParallelDims,
                 fsdp_modules: list[nn.Module]) -> None:
        super().__init__(parameters, mesh, dims)
        self.fsdp_modules = fsdp_modules

    def requires_gradient_sync(self, enabled: bool) -> None:
        for module in self.fsdp_modules:  # the roots; the setting recurses into every unit
            module.set_requires_gradient_sync(enabled)
