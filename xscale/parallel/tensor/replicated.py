"""Parameters replicated over a tensor-parallel group, used as local tensors by plain PyTorch code.

Under tensor parallelism every parameter is a DTensor on the tp mesh, so that optimizers, gradient clipping,
checkpoints and FSDP see one kind of tensor. Modules that tensor parallelism does not split (norms, MoE
layers, position tables, Linformer's length projections, MQA's single kv head) keep running their
single-device code on local tensors: :func:`replicate_parameters` makes their parameters ``Replicate``
DTensors, and while the module's forward runs (or, for a position encoding, the forward of the model and of each
attention layer, which call its ``embed`` / ``rotate`` / ``bias``) each parameter slot holds the DTensor's local
tensor, swapped in and back by forward hooks (:class:`LocalSlots`): no module class or attribute is changed.
Outside those calls the slots hold the DTensor parameters, so FSDP, tied weights and checkpoints see the usual
module.

The gradient reaches the DTensor in one of two ways:
  * every tp rank runs the module on the same full input (norms, MoE, learned positions): each rank already
    holds the whole gradient, nothing is communicated;
  * each rank's use covers part of the work (its own heads: T5's bias table, Linformer's projections, MQA's
    kv weights; its own tokens: norms under sequence parallelism): the local tensor is taken through
    Megatron's *f* operator (identity forward, all-reduce backward; Shoeybi et al. 2019, sec. 3), so the
    gradient is summed over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from xscale.runtime.eager import eager_under_compile


class SumGradients(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumValues(torch.autograd.Function):
    """All-reduce (sum) forward over ``group``; identity backward (Megatron's *g*, Shoeybi et al. 2019, sec. 3):
    for partial values whose sum every rank then uses alike, so each rank's gradient is already the whole one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        summed = x.contiguous().clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class LocalSlots:
    """Swaps a module's DTensor parameters / buffers for their local tensors while the module computes.

    Registered as the module's forward pre-hook and forward hook (``always_call``: restored on errors too), and,
    for code outside the module that computes with them (a position table read by every attention layer), on the
    modules whose forward does. ``replicated``: Replicate parameters, taken through *f* when ``group`` is set (each
    rank's gradient is partial); ``sharded``: Shard(0) parameters and buffers used as this rank's rows (their
    gradients keep the shards' placements; in-place updates of a buffer land in the DTensor's local storage).
    A slot that already holds a plain tensor (an enclosing forward swapped it) is left to whoever swapped it.
    The swaps run eagerly inside compiled blocks (``train.compile``): traced, the first step's swapped-in tensor was
    baked into the graph, and the second step's backward ran through the first step's freed graph.
    """

    def __init__(self, module: nn.Module, replicated: tuple[str, ...], sharded: tuple[str, ...],
                 group: dist.ProcessGroup | None) -> None:
        self.module, self.replicated, self.sharded, self.group = module, replicated, sharded, group
        self._swapped: list[list[tuple[dict, str, torch.Tensor]]] = []  # a stack: one entry per open forward

    def register_on(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.swap_in)
        module.register_forward_hook(self.swap_back, always_call=True)

    @eager_under_compile
    def swap_in(self, *_) -> None:
        swapped: list[tuple[dict, str, torch.Tensor]] = []
        slots = self.module._parameters
        for name in self.replicated:
            param = slots[name]
            if isinstance(param, DTensor):
                local = param.to_local()
                slots[name] = SumGradients.apply(local, self.group) if self.group is not None else local
                swapped.append((slots, name, param))
        for name in self.sharded:
            slots = self.module._parameters if name in self.module._parameters else self.module._buffers
            state = slots[name]
            if isinstance(state, DTensor):
                if isinstance(state, nn.Parameter):
                    slots[name] = state.to_local()  # its gradient comes back as this rank's shard
                else:
                    with torch.no_grad():
                        slots[name] = state.to_local()  # the local storage itself: updates in place persist
                swapped.append((slots, name, state))
        self._swapped.append(swapped)

    @eager_under_compile
    def swap_back(self, *_) -> None:
        if not self._swapped:
            return  # a pre-hook before ours raised, so ours never ran
        for slots, name, state in reversed(self._swapped.pop()):
            slots[name] = state


def replicate_parameters(module: nn.Module, mesh: DeviceMesh, *, sum_gradients: bool,
                         used_in: tuple[nn.Module, ...] = ()) -> None:
    """Every parameter under ``module`` becomes a Replicate DTensor on ``mesh``, used as its local tensor while the
    module (and each of ``used_in``, whose forward calls the module's methods directly) computes.

    ``sum_gradients``: each rank's use yields a partial gradient, all-reduced over the mesh's group in
    backward. Parameters that are already DTensors are left alone. On a materialised module every rank must
    hold the same values.
    """
    group = mesh.get_group() if sum_gradients else None
    for submodule in module.modules():
        names = []
        for name, param in list(submodule._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            replicated = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            submodule.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
            names.append(name)
        if names:
            slots = LocalSlots(submodule, tuple(names), (), group)
            for user in (module, *used_in):  # the outermost forward swaps; inner ones find local tensors
                slots.register_on(user)
