"""Deterministic weight initialisation from the seed and each parameter's name.

Every parameter is drawn from its own generator seeded by (seed, name), as a full tensor, and
then sliced to whatever shard this rank holds. The weights are therefore identical for every
parallel layout, which is what makes loss parity against one device a meaningful test.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.blocks.gtrxl import GATE_BIAS
from xscale.models.deepnorm import deepnorm_init_std
from xscale.models.registry import BLOCK
from xscale.runtime.hooks import ResetsBuffers

# Output projections of residual branches: std scaled by 1/sqrt(2 * layers) (GPT-2, Radford et al. 2019).
RESIDUAL_OUTPUTS = ("wo.weight", "w_out.weight", "w_down.weight")


def parameter_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def initial_value(name: str, shape: torch.Size, config: ModelConfig, seed: int) -> torch.Tensor:
    """The full-size initial value of parameter ``name`` (fp32, CPU)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if "norm" in owner or leaf == "scale":
        if leaf == "scale":
            return torch.full(shape, math.sqrt(config.d_model))
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias" or leaf == "rezero_alpha":  # ReZero's alpha starts at 0 (Bachlechner et al. 2020)
        return torch.zeros(shape)
    if leaf == "gate_bias":  # GTrXL's b_g: each gate starts near the identity (Parisotto et al. 2019)
        return torch.full(shape, GATE_BIAS)
    if leaf == "admin_omega":
        return torch.full(shape, admin_omega(name, config))
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    std = config.init_std
    deepnorm_std = deepnorm_init_std(name, tuple(shape), config) if config.norm_placement == "deepnorm" else None
    if deepnorm_std is not None:
        return torch.randn(shape, generator=generator) * deepnorm_std
    if name.endswith(RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2 * config.total_layers)
    if "router" in name:
        std = std * 0.1  # small router init (Switch, Fedus et al. 2021, sec. 2.4)
    return torch.randn(shape, generator=generator) * std


def admin_omega(name: str, config: ModelConfig) -> float:
    """Admin's omega_i = sqrt(sum_{j<i} Var[f_j]) (Liu et al. 2020, sec. 4.3) in closed form: counting the
    embedding and each earlier residual branch of the stack as one unit of variance (a post-norm block's branches
    read normalised inputs), the i-th residual (1-based: attention, cross-attention, FFN of each layer in turn)
    gets omega_i = sqrt(i), the residuals of a block in the order its kind runs them (``residual_names``).
    ``name``: ``<stack>.layers.<l>.<residual>.gain.admin_omega``."""
    stack, rest = name.split(".layers.", 1)
    layer, residual = rest.removesuffix(".gain.admin_omega").split(".", 1)
    with_cross = stack == "decoder" and config.family == "encoder_decoder"
    order = BLOCK.get(config.block.kind).residual_names(with_cross)
    return math.sqrt(int(layer) * len(order) + order.index(residual) + 1)


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-size value ``full`` into ``param``: the whole of it, or a DTensor's local shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # models/ runs without torch.distributed

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def init_weights(model: nn.Module, config: ModelConfig, seed: int, names: dict[int, str] | None = None) -> None:
    """Fill every parameter deterministically; ``names`` maps id(param) to its canonical name
    (so a wrapped or pipeline-split model gets the weights of the unwrapped one)."""
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        canonical = names.get(id(param), canonical_name(name)) if names else canonical_name(name)
        copy_into(param, initial_value(canonical, param.shape, config, seed))
    for module in model.modules():
        if isinstance(module, ResetsBuffers):
            with _full_size_buffers(module):
                module.reset_buffers()


@contextlib.contextmanager
def _full_size_buffers(module: nn.Module) -> Iterator[None]:
    """Within the block a DTensor buffer of ``module`` (a tensor-parallel core's per-head state) is a full-size
    plain tensor, so ``reset_buffers`` computes the single process's values; on leaving each rank keeps its rows."""
    from torch.distributed.tensor import DTensor  # models/ runs without torch.distributed

    swapped: list[tuple[str, torch.Tensor]] = []
    try:
        for name, state in list(module._buffers.items()):
            if isinstance(state, DTensor):
                module._buffers[name] = torch.empty(state.shape, dtype=state.dtype, device=state.to_local().device)
                swapped.append((name, state))
        yield
        for name, state in swapped:
            copy_into(state, module._buffers[name])
    finally:
        for name, state in swapped:
            module._buffers[name] = state


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes (torch.compile, checkpoint wrappers, FSDP) from a parameter name."""
    for prefix in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name
