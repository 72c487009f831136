"""Which parameters the tensor-parallel plan splits over the tp ranks, and along which dim, read from the same
declarations the plan applies (:mod:`xscale.parallel.tensor.plan`), without a process group or a mesh.

A block kind's ``tensor_parallel_parts()`` (:class:`~xscale.models.traits.BlockParts`) names its attentions, its
residuals and its other modules. An attention's q (and k, v when the tp ranks hold whole kv heads:
:func:`attention_split`) are column-parallel, its output projection row-parallel, and its core's
``per_head_state`` split by head; a module declaring ``tp="split_hidden"`` has its ``column_parallel`` and
``row_parallel`` linears split the same way and its ``split_rows`` by rows. As torch's ``ColwiseParallel`` does, a
column-parallel linear splits its weight and bias by output features; ``RowwiseParallel`` splits the weight by
input features and keeps the bias whole (it is added after the reduction). The embedding and the output projection
are split by vocabulary. Everything else is whole on every rank: norms and residual gains, position tables, MoE
layers (their experts too), ``per_token`` modules (GTrXL's gates, the Evolved Transformer's GLU and convolutions),
MQA's single kv head, the cores' shared parameters and BERT's head transform.

The memory estimator counts each rank's parameters from :func:`parameter_shards`
(:mod:`xscale.estimate.memory`); tests/estimate/test_tensor_parallel_state.py checks it against the plan applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from xscale.models.attention import Attention
from xscale.models.traits import traits_of

# The dim each of a linear's parameters is split along (torch.distributed.tensor.parallel's styles).
COLUMN_PARALLEL = {"weight": 0, "bias": 0}  # output features
ROW_PARALLEL = {"weight": 1}  # input features; the bias is replicated
VOCABULARY_PARALLEL = {"weight": 0}  # the embedding's rows, the output projection's (column-parallel) rows


@dataclass(frozen=True)
class AttentionSplit:
    """An attention's projections by how the plan splits them: ``column`` (by heads), ``row`` (the output
    projection) and ``replicated`` (k and v when the ranks cannot hold whole kv heads: MQA's single kv head)."""

    column: tuple[str, ...]
    row: tuple[str, ...]
    replicated: tuple[str, ...]


def attention_split(attention: Attention, tp: int) -> AttentionSplit:
    """How the plan splits ``attention``'s projections over ``tp`` ranks (its core's config: Lite's attention half
    has n_heads/2 heads and n_kv_heads/2 kv heads)."""
    kv_projections = ("wk", "wv") if attention.projects_keys else ("wv",)
    if attention.core.model_config.kv_heads % tp == 0:
        return AttentionSplit(("wq", *kv_projections), ("wo",), ())
    return AttentionSplit(("wq",), ("wo",), kv_projections)


def _mark(shards: dict[str, int], module: nn.Module, path: str, dims: dict[str, int]) -> None:
    """Record the split dim of each of ``dims``' parameters that the module at ``path`` holds."""
    for name, dim in dims.items():
        if module._parameters.get(name) is not None:
            shards[f"{path}.{name}" if path else name] = dim


def _mark_linears(shards: dict[str, int], module: nn.Module, path: str, names: tuple[str, ...],
                  dims: dict[str, int]) -> None:
    """As :func:`_mark`, for the linears at ``names`` under ``module`` (one a core does not use is absent: skipped,
    as the plan's ``parallelize_module`` skips it)."""
    held = dict(module.named_modules())
    for name in names:
        if name in held:
            _mark(shards, held[name], f"{path}.{name}", dims)


def block_shards(block: nn.Module, tp: int) -> dict[str, int]:
    """The split parameters of ``block`` (paths inside it) and the dim each is split along; the block's other
    parameters are whole on every rank (module docstring)."""
    shards: dict[str, int] = {}
    parts = block.tensor_parallel_parts()
    for path in parts.attentions:
        attention = block.get_submodule(path)
        split = attention_split(attention, tp)
        _mark_linears(shards, attention, path, split.column, COLUMN_PARALLEL)
        _mark_linears(shards, attention, path, split.row, ROW_PARALLEL)
        per_head = getattr(type(attention.core), "per_head_state", ())
        _mark(shards, attention.core, f"{path}.core", dict.fromkeys(per_head, 0))
    for path in parts.modules:
        module = block.get_submodule(path)
        traits = traits_of(module)
        if traits.tp != "split_hidden":
            continue  # per_token and replicated modules are whole on every rank
        _mark_linears(shards, module, path, traits.column_parallel, COLUMN_PARALLEL)
        _mark_linears(shards, module, path, traits.row_parallel, ROW_PARALLEL)
        for row_path in traits.split_rows:
            owner, _, name = row_path.rpartition(".")
            _mark(shards, module.get_submodule(owner), f"{path}.{owner}" if owner else path, {name: 0})
    return shards


def parameter_shards(model: nn.Module, tp: int) -> dict[str, int | None]:
    """Each parameter of ``model`` (a Transformer or a pipeline stage cut from it; by its ``named_parameters`` name,
    a tied weight once) and the dim the plan splits it along over ``tp`` ranks, or None where every rank holds it
    whole."""
    shards: dict[str, int] = {}
    for name in ("embedding", "output"):
        module = getattr(model, name, None)
        if module is not None:
            _mark(shards, module, name, VOCABULARY_PARALLEL | ({"bias": 0} if name == "output" else {}))
    for stack_name in ("stack", "decoder"):
        stack = getattr(model, stack_name, None)
        if stack is None:
            continue
        for key, block in stack.layers.items():
            prefix = f"{stack_name}.layers.{key}"
            shards.update({f"{prefix}.{path}": dim for path, dim in block_shards(block, tp).items()})
    return {name: shards.get(name) for name, _ in model.named_parameters()}
