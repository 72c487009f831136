"""Parameters replicated over a tensor-parallel group, used as local tensors by plain PyTorch code.

Under tensor parallelism every parameter is a DTensor on the tp mesh, so that optimizers, gradient clipping,
checkpoints and FSDP see one kind of tensor. Modules that tensor parallelism does not split (norms, MoE
layers, position tables, Linformer's length projections, MQA's single kv head) keep running their
single-device code on local tensors: :func:`replicate_parameters` makes their parameters ``Replicate``
DTensors, and while one of the module's computing methods runs (``forward``; ``embed``/``rotate``/``bias``
for a position encoding) each parameter slot holds the DTensor's local tensor. Outside those calls the
slots hold the DTensor parameters, so FSDP, tied weights and checkpoints see the usual module.

The gradient reaches the DTensor in one of two ways:
  * every tp rank runs the module on the same full input (norms, MoE, learned positions): each rank already
    holds the whole gradient, nothing is communicated;
  * each rank's use covers part of the work (its own heads: T5's bias table, Linformer's projections, MQA's
    kv weights; its own tokens: norms under sequence parallelism): the local tensor is taken through
    Megatron's *f* operator (identity forward, all-reduce backward; Shoeybi et al. 2019, sec. 3), so the
    gradient is summed over the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

# Set on each module whose parameters were replicated: their names, and the group summing their gradients.
LOCAL_NAMES = "_tensor_parallel_local_parameters"
GRADIENT_GROUP = "_tensor_parallel_gradient_group"
# Set on each module whose parameters/buffers are sharded DTensors used as their local shards
# (:mod:`xscale.parallel.tensor.head_sharded`): their names.
SHARDED_NAMES = "_tensor_parallel_sharded_state"


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


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, the replicated parameters under ``module`` are their local tensors, and so are its
    sharded parameters and buffers (their gradients keep the shards' placements; in-place updates of a buffer
    land in the DTensor's local storage)."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for submodule in module.modules():
            group = submodule.__dict__.get(GRADIENT_GROUP)
            for name in submodule.__dict__.get(LOCAL_NAMES, ()):
                param = submodule._parameters[name]
                if not isinstance(param, DTensor):
                    continue  # an enclosing module's call already swapped it
                local = param.to_local()
                submodule._parameters[name] = SumGradients.apply(local, group) if group is not None else local
                swapped.append((submodule._parameters, name, param))
            for name in submodule.__dict__.get(SHARDED_NAMES, ()):
                slots = submodule._parameters if name in submodule._parameters else submodule._buffers
                state = slots[name]
                if not isinstance(state, DTensor):
                    continue
                if isinstance(state, nn.Parameter):
                    slots[name] = state.to_local()  # its gradient comes back as this rank's shard
                else:
                    with torch.no_grad():
                        slots[name] = state.to_local()  # the local storage itself: updates in place persist
                swapped.append((slots, name, state))
        yield
    finally:
        for slots, name, state in reversed(swapped):
            slots[name] = state


_CLASSES: dict[tuple[type, tuple], type] = {}


def computing_within(cls: type, contexts: tuple[tuple[str, Callable[[nn.Module], contextlib.AbstractContextManager]],
                                                ...], prefix: str = "Replicated") -> type:
    """A subclass of ``cls`` whose methods named in ``contexts`` run inside their context (cached per class)."""
    key = (cls, contexts)
    if key not in _CLASSES:
        def wrap(name: str, context):
            original = getattr(cls, name)

            def method(self, *args, **kwargs):
                with context(self):
                    return original(self, *args, **kwargs)

            method.__name__ = method.__qualname__ = name
            method.__doc__ = original.__doc__
            return method

        attributes = {name: wrap(name, context) for name, context in contexts}
        attributes.update(__module__=cls.__module__, _computes_with_local_parameters=True)
        _CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,), attributes)
    return _CLASSES[key]


def replicate_parameters(module: nn.Module, mesh: DeviceMesh, *, sum_gradients: bool,
                         methods: tuple[str, ...] = ("forward",)) -> None:
    """Every parameter under ``module`` becomes a Replicate DTensor on ``mesh``, used locally by ``methods``.

    ``sum_gradients``: each rank's use yields a partial gradient, all-reduced over the mesh's group in
    backward. Parameters that are already DTensors are left alone. On a materialised module every rank must
    hold the same values.
    """
    group = mesh.get_group() if sum_gradients else None
    replicated_any = False
    for submodule in module.modules():
        names = []
        for name, param in list(submodule._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            replicated = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            submodule.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
            names.append(name)
        if names:
            setattr(submodule, LOCAL_NAMES, tuple(names))
            setattr(submodule, GRADIENT_GROUP, group)
            replicated_any = True
    if replicated_any and not getattr(type(module), "_computes_with_local_parameters", False):
        module.__class__ = computing_within(type(module), tuple((name, local_parameters) for name in methods))
