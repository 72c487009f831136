"""Expert parallelism (GShard, Lepikhin et al. 2020): experts sharded over an ``ep`` group folded into data parallel.

The ranks of one ep group hold different experts and see different tokens. Each MoE layer sorts its kept
assignments by expert, exchanges per-expert counts, sends the tokens to the rank owning their expert with
``all_to_all_single`` (uneven splits), applies its local experts, sends the outputs back with the inverse
exchange and combines them by gate weight. Routing decisions (capacity, load-balancing fractions) are made
over the tokens of the whole ep group, so outputs and gradients equal one device's on those tokens.

Checkpoints: parameter names do not change. Expert weights keep their leading expert dimension, now local:
rank r of an ep group of size P holds rows ``[r * E/P, (r + 1) * E/P)`` of every full ``...experts.<proj>.weight``
/ ``.bias`` [E, ...] (:func:`shard_expert_state_dict` cuts a full state dict; the trainer's checkpoints show
them in the global shape, :mod:`xscale.parallel.expert.state`). Gradients of expert weights must be reduced
only over the data-parallel ranks that hold the same experts, those of other weights over every data-parallel
rank. In the trainer's layouts (:func:`xscale.parallel.parallelize.parallelize`) the ep group is ``mesh["ep"]``,
consecutive data-parallel ranks, so one routing group is a contiguous slice of the global batch.

With tensor parallelism on attention (``ep x tp``) the MoE layers are replicated over tp
(:mod:`xscale.parallel.tensor`): the tp ranks of a data-parallel rank route the same tokens, each through the ep
group of its own tp coordinate, and hold the same expert slice as Replicate DTensors. Their expert gradients are
then already whole on every tp rank (not summed over tp), reduced over ``edp`` only, and counted once in the
gradient norm (each slice has edp x tp replicas).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from xscale.config.schema import ConfigError
from xscale.models.moe import MoELayer, moe_layers
from xscale.parallel.collectives import all_gather_flat
from xscale.runtime import Placement, TokenGroup


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        output = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(output, x.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_input = grad_output.new_empty((sum(input_splits), *grad_output.shape[1:]))
        dist.all_to_all_single(grad_input, grad_output.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_input, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable uneven all-to-all over dimension 0 (works on gloo and nccl)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallelTokens:
    """The routing group of an ep group: every rank's tokens, in rank order. ``within``: the group each rank's own
    tokens belong to when that spans ranks too (under context parallelism its cp group, which holds slices of the same
    sequences), gathered first; then the ep group concatenates whole sequences, as one device holds them."""

    def __init__(self, group: dist.ProcessGroup, within: TokenGroup | None = None) -> None:
        self.group, self.within = group, within
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, inner = (rows.reshape(-1, rows.shape[-1]), None) if self.within is None else self.within.gather(rows)
        count = torch.tensor([rows.shape[0]], dtype=torch.long, device=rows.device)
        counts = count.new_empty(self.size)
        all_gather_flat(counts, count, group=self.group)
        counts = counts.tolist()
        longest = max(counts)
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        everyone = rows.new_empty((self.size * longest, *rows.shape[1:]))
        all_gather_flat(everyone, padded.contiguous(), group=self.group)
        pieces = [everyone[r * longest: r * longest + counts[r]] for r in range(self.size)]
        first = sum(counts[: self.rank])
        mine = torch.arange(first, first + rows.shape[0], device=rows.device) if inner is None else inner + first
        return torch.cat(pieces), mine

    def all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone() if self.within is None else self.within.all_reduce(value)
        dist.all_reduce(total, group=self.group)
        return total


class ExpertParallelExchange(ExpertParallelTokens):
    """The MoE layers' :class:`~xscale.runtime.ExpertExchange` over an ep group: route over every rank's tokens;
    send expert-sorted tokens to the ranks that own their experts, apply the local experts, send the outputs back."""

    experts_local = False

    def dispatch(self, tokens_by_expert: torch.Tensor, tokens_per_expert: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        local_experts = experts.num_experts
        # received[s, l]: tokens rank s sends to my local expert l.
        received = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received, tokens_per_expert, group=self.group)
        received = received.view(self.size, local_experts)
        send_splits = tokens_per_expert.view(self.size, local_experts).sum(1).tolist()
        receive_splits = received.sum(1).tolist()
        arrived = all_to_all(tokens_by_expert, receive_splits, send_splits, self.group)

        # Arrivals are grouped by source rank, then expert; the experts want them grouped by expert.
        chunk_rows = torch.arange(arrived.shape[0], device=arrived.device).split(received.reshape(-1).tolist())
        expert_major = torch.cat([chunk_rows[s * local_experts + e]
                                  for e in range(local_experts) for s in range(self.size)])
        # index_select: its backward is an index_add (advanced indexing's is a slow accumulating index_put)
        outputs = experts(arrived.index_select(0, expert_major), received.sum(0).tolist())
        source_major = torch.empty_like(expert_major)
        source_major[expert_major] = torch.arange(expert_major.numel(), device=expert_major.device)
        return all_to_all(outputs.index_select(0, source_major), send_splits, receive_splits, self.group)


def _resolve_group(ep_group_or_mesh: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    if isinstance(ep_group_or_mesh, DeviceMesh):
        mesh = ep_group_or_mesh
        if mesh.ndim == 1:
            return mesh.get_group()
        if "ep" not in (mesh.mesh_dim_names or ()):
            raise ConfigError(f"expert parallelism needs a mesh dimension named 'ep'; this mesh has {mesh.mesh_dim_names}")
        return mesh["ep"].get_group()
    return ep_group_or_mesh


def shard_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """The experts [first, last) that rank ``ep_rank`` of an ep group of ``ep_size`` holds."""
    if num_experts % ep_size:
        raise ConfigError(f"model.moe.num_experts={num_experts} is not divisible by parallel.ep={ep_size}; "
                          f"pick ep from {[p for p in range(1, num_experts + 1) if num_experts % p == 0]}")
    local = num_experts // ep_size
    return ep_rank * local, (ep_rank + 1) * local


def shard_expert_state_dict(state_dict: dict[str, torch.Tensor], num_experts: int, ep_rank: int,
                            ep_size: int) -> dict[str, torch.Tensor]:
    """A full (single-device) state dict -> the one rank ``ep_rank`` loads: expert tensors cut on dim 0."""
    first, last = shard_range(num_experts, ep_rank, ep_size)
    return {name: tensor[first:last] if ".experts." in f".{name}" else tensor
            for name, tensor in state_dict.items()}


@torch.no_grad()
def _shard_experts(layer: MoELayer, first: int, last: int) -> None:
    """Keep experts [first, last); a tensor-parallel (Replicate DTensor) parameter stays one, on its mesh."""
    for module in layer.experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                rows = DTensor.from_local(param.to_local()[first:last].clone(), param.device_mesh, param.placements,
                                          run_check=False)
            else:
                rows = param[first:last].clone()
            module.register_parameter(name, nn.Parameter(rows, requires_grad=param.requires_grad))


def apply_expert_parallel(model: nn.Module, ep_group_or_mesh: dist.ProcessGroup | DeviceMesh,
                          within: TokenGroup | None = None) -> Placement:
    """Keep this rank's experts in every MoE layer of a materialised model; returns the placement that gives each
    forward's context the exchange routing tokens by all-to-all (``ParallelModel(place=...)``; a forward without
    it is refused).

    ``ep_group_or_mesh``: the ep process group, a 1-D mesh, or a mesh with an ``ep`` dimension; ``within``: see
    :class:`ExpertParallelTokens`.
    """
    group = _resolve_group(ep_group_or_mesh)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoE layer (model.moe.num_experts=0)")
    for layer in layers:
        if layer.experts.num_experts != layer.num_experts:
            raise ValueError(f"MoE layer {layer.layer_index} is already expert-parallel")
        first, last = shard_range(layer.num_experts, rank, size)
        _shard_experts(layer, first, last)
    return expert_parallel_context(group, within)


def expert_parallel_context(ep_group_or_mesh: dist.ProcessGroup | DeviceMesh,
                            within: TokenGroup | None = None) -> Placement:
    """What a forward of an expert-parallel model must be told: the ep group's token exchange."""
    exchange = ExpertParallelExchange(_resolve_group(ep_group_or_mesh), within)
    return lambda context: context.with_experts(exchange)
