"""Parameters replicated over a tensor-parallel group, read as local tensors by plain PyTorch code.

Under tensor parallelism every parameter is a DTensor on the tp mesh, so that optimizers, gradient clipping,
checkpoints and FSDP see one kind of tensor. Modules that tensor parallelism does not split (norms outside
sequence parallelism, MoE layers, position tables, Linformer's length projections, MQA's single kv head) keep
running their single-device code on local tensors: :func:`replicate_parameters` makes their parameters
``Replicate`` DTensors and reading ``module.<name>`` gives the local tensor.

The gradient of such a parameter reaches it in one of two ways:
  * every tp rank runs the module on the same full input (norms, MoE, learned positions): each rank already
    holds the whole gradient, nothing is communicated;
  * each rank uses the parameter for its own heads only (T5's bias table, Linformer's projections, MQA's kv
    weights): each holds a partial sum, and the read goes through Megatron's *f* operator (identity forward,
    all-reduce backward; Shoeybi et al. 2019, sec. 3), so the gradient is summed over the group.

Reads go through a descriptor on a per-class subclass (the technique FSDP2's ``fully_shard`` uses), so the
model code, the parameter names and ``state_dict`` stay those of the single-device model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

SUM_GROUP_ATTRIBUTE = "_tensor_parallel_gradient_group"


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


class LocalParameter:
    """Class attribute: ``module.<name>`` reads the local tensor of a Replicate DTensor parameter."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        parameters = module.__dict__["_parameters"]
        if self.name not in parameters:
            raise AttributeError(f"'{type(module).__name__}' object has no attribute '{self.name}'")
        param = parameters[self.name]
        if not isinstance(param, DTensor):
            return param
        local = param.to_local()
        group = module.__dict__.get(SUM_GROUP_ATTRIBUTE)
        return SumGradients.apply(local, group) if group is not None else local


_VIEW_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _read_parameters_locally(module: nn.Module, names: tuple[str, ...]) -> None:
    cls = type(module)
    if getattr(cls, "_reads_local_parameters", False):
        names = tuple(sorted({*names, *(n for n, v in vars(cls).items() if isinstance(v, LocalParameter))}))
        cls = cls.__bases__[0]
    key = (cls, names)
    if key not in _VIEW_CLASSES:
        attributes = {name: LocalParameter(name) for name in names}
        attributes["_reads_local_parameters"] = True
        attributes["__module__"] = cls.__module__
        _VIEW_CLASSES[key] = type(f"Replicated{cls.__name__}", (cls,), attributes)
    module.__class__ = _VIEW_CLASSES[key]


def replicate_parameters(module: nn.Module, mesh: DeviceMesh, *, sum_gradients: bool) -> None:
    """Every parameter under ``module`` becomes a Replicate DTensor on ``mesh``, read as its local tensor.

    ``sum_gradients``: each rank's use of the parameters yields a partial gradient (per-head use), so the
    gradient is all-reduced over the mesh's group in backward. Parameters that are already DTensors are left
    as they are. On a materialised module every rank must hold the same values.
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
            setattr(submodule, SUM_GROUP_ATTRIBUTE, group)
            _read_parameters_locally(submodule, tuple(names))
