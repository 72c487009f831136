"""FP8 training of the Transformer blocks' linear layers, through torchao's float8 training (``train.precision=fp8``).

Each converted ``nn.Linear`` runs its three GEMMs (output, input gradient, weight gradient) on FP8 operands with
dynamic scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning": E4M3 for weights and activations, E5M2
for gradients): x_fp8 = cast(x * s), s = max_fp8 / amax(x), per tensor (``tensorwise``) or per row (``rowwise``),
and the GEMM's result is divided by the scales. Everything else (embeddings, norms, attention scores, the output
head, MoE experts and routers) stays in bf16 autocast. The weights, their gradients and the optimizer state keep
their own dtype, and the parameter names do not change, so a checkpoint moves freely between fp8 and bf16 runs.

Not our own kernels: torchao's ``Float8Linear`` (GPU: cuBLAS/CUTLASS FP8 GEMMs on compute capability 8.9+;
CPU: torch's reference FP8 GEMM, which is how the suite checks it). With ``train.compile`` the casts fuse into
the neighbouring kernels; eager, they are separate passes over the activations.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from xscale.config.schema import ConfigError
from xscale.runtime.cpu_flags import cpu_flags

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_ALIGNMENT = 16  # FP8 GEMMs want both dimensions of the weight a multiple of 16
logger = logging.getLogger(__name__)


def float8_refusal(device: torch.device) -> str | None:
    """Why fp8 training cannot run on ``device`` (one line), or None."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"train.precision=fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
                    f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}: use train.precision=bf16")
    elif device.type != "cpu":
        return f"train.precision=fp8 runs on CUDA (8.9+) or on the CPU (for tests), not on '{device.type}'"
    try:
        _import_float8()
    except ImportError:
        return ("train.precision=fp8 trains the linear layers through torchao's float8 training, which is not "
                "installed: pip install 'torchao>=0.18' (or use train.precision=bf16)")
    return None


def takes_float8(module: nn.Module, name: str) -> bool:
    """An ``nn.Linear`` inside a Transformer block (``...layers.N...``) with both weight dimensions multiples of
    16; not the output head, the embedding or an MoE router (not ``nn.Linear``s, or outside the blocks)."""
    if type(module) is not nn.Linear or ".layers." not in f".{name}":
        return False
    return all(size % FP8_ALIGNMENT == 0 for size in module.weight.shape)


def use_float8(model: nn.Module, recipe: str, device: torch.device) -> list[str]:
    """Convert ``model``'s block linears (:func:`takes_float8`) to torchao's ``Float8Linear`` with ``recipe``
    scaling, in place, on a meta or a materialised model (before tensor parallelism, FSDP and compilation).
    Returns the converted modules' names."""
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8_recipe='{recipe}' is not one of {', '.join(FP8_RECIPES)}")
    if (why := float8_refusal(device)) is not None:
        raise ConfigError(why)
    float8 = _import_float8()
    chosen = [name for name, module in model.named_modules() if takes_float8(module, name)]
    if not chosen:
        raise ConfigError("train.precision=fp8 found no linear layer to run in FP8: the blocks' nn.Linear weights "
                          f"need both dimensions multiples of {FP8_ALIGNMENT} (model.d_model, model.d_ff, heads)")
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=lambda module, name: name in chosen)
    if needs_reference_cpu_gemm(recipe, device):
        torch.backends.mkldnn.enabled = False
        logger.warning("fp8_recipe=rowwise on a CPU with AMX: torch's oneDNN FP8 GEMM takes one scale per tensor, "
                       "so oneDNN is off in this process and the per-row scales go through torch's reference GEMM")
    return chosen


def needs_reference_cpu_gemm(recipe: str, device: torch.device) -> bool:
    """Whether the rowwise recipe must bypass oneDNN on this CPU. torch's CPU FP8 GEMM (``torch._scaled_mm``)
    hands a float8 x float8 product to oneDNN on CPUs with AMX-INT8 (its test: ``cpuinfo_has_x86_amx_int8``) while
    oneDNN is enabled, and that path asserts one scale per tensor; with oneDNN off, the same call takes torch's
    reference GEMM, which applies per-row scales. Tensorwise scales run on both paths."""
    return (device.type == "cpu" and recipe == "rowwise" and torch.backends.mkldnn.enabled
            and "amx_int8" in cpu_flags())


def float8_linears(modules) -> int:
    """How many of ``modules``' submodules run in FP8 (torchao's ``Float8Linear``)."""
    return sum(type(sub).__name__ == "Float8Linear" for module in modules for sub in module.modules())


def _import_float8():
    """``torchao.float8``, imported without the warnings a CPU-only torch draws from it (its CUDA extensions do not
    load, torch's pytree notes a deprecated registration): noise for every rank of every run."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return torchao.float8
