"""An attention core's per-head state split by head over a tensor-parallel group (and, by :func:`shard_rows`, state
whose rows follow a split hidden width: Lite's convolution kernels).

Tensor parallelism gives rank r the heads [r H/tp, (r + 1) H/tp) (Megatron-LM, Shoeybi et al. 2019, sec. 3).
A core that keeps state per head names it in ``per_head_state`` (dim 0 = heads): Gaussian and adaptive-span
widths, the Synthesizer's weights, the pooling points of inducing/ISAB/Luna, routing attention's centroids and
their pending k-means statistics. :func:`shard_head_state` makes each of those parameters and buffers a
``Shard(0)`` DTensor on the tp mesh, so a rank stores only its heads' rows, checkpoints see the full-size tensor
(and reshard it to another layout), and ``init_weights`` slices the single-process initial value.

While the core's forward runs (forward hooks: :class:`xscale.parallel.tensor.replicated.LocalSlots`) each slot holds
the local shard, so the core's single-device code sees its H/tp heads: a parameter's gradient comes back as
this rank's shard (no communication: no other rank uses these heads), and in-place buffer updates (routing's
centroids) land in the DTensor's local storage. ``reset_buffers`` runs on full-size buffers (the single
process's values) and each rank keeps its rows (:func:`xscale.models.init.init_weights`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from xscale.parallel.tensor.replicated import LocalSlots


def _shard(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Rows [r H/tp, (r + 1) H/tp) of ``tensor`` (on the meta device: just the shape)."""
    return distribute_tensor(tensor.detach(), mesh, [Shard(0)], src_data_rank=None if tensor.is_meta else 0)


def shard_head_state(core: nn.Module, mesh: DeviceMesh) -> None:
    """The parameters and buffers ``type(core).per_head_state`` names become ``Shard(0)`` DTensors on the 1-D
    ``mesh``, used as local shards by ``forward``. Call it before
    :func:`~xscale.parallel.tensor.replicated.replicate_parameters` on the core (which leaves DTensors alone)."""
    names, split_before = [], False
    for name in getattr(type(core), "per_head_state", ()):
        state = getattr(core, name, None)
        if state is None:
            continue  # e.g. the Synthesizer's weights of the modes not chosen
        heads = core.model_config.n_heads
        if state.shape[0] != heads or heads % mesh.size():
            raise ValueError(f"{type(core).__name__}.{name} has {state.shape[0]} rows, which cannot be split as "
                             f"{heads} heads over tp={mesh.size()}")
        names.append(name)
        if isinstance(state, DTensor):
            split_before = True  # a shared layer's core, split (and hooked) already
            continue
        if name in core._parameters:
            core.register_parameter(name, nn.Parameter(_shard(state, mesh), requires_grad=state.requires_grad))
        else:
            core._buffers[name] = _shard(state, mesh)
    if names and not split_before:
        LocalSlots(core, (), tuple(names), None).register_on(core)


def shard_rows(module: nn.Module, paths: tuple[str, ...], mesh: DeviceMesh) -> None:
    """The parameters at ``paths`` under ``module`` (dotted, e.g. ``convolution.kernel``) become ``Shard(0)``
    DTensors on the 1-D ``mesh``, each used as this rank's rows while the module owning it computes: state whose
    rows follow a split hidden width (``parallel_traits.split_rows``)."""
    for path in paths:
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        state = owner._parameters[name]
        if isinstance(state, DTensor):
            continue  # a shared block's, split (and hooked) already
        if state.shape[0] % mesh.size():
            raise ValueError(f"{type(module).__name__}.{path} has {state.shape[0]} rows, which cannot be split over "
                             f"tp={mesh.size()}")
        owner.register_parameter(name, nn.Parameter(_shard(state, mesh), requires_grad=state.requires_grad))
        LocalSlots(owner, (), (name,), None).register_on(owner)

