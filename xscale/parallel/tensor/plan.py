"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Each block is split the Megatron way: q/k/v projections column-wise (every rank holds n_heads/tp heads and
n_kv_heads/tp kv heads), the attention output projection row-wise; FFN input projections column-wise, the
output projection row-wise; so each sub-layer costs one all-reduce forward and one backward. Which modules of a
block are attentions, FFNs or other parts (GTrXL's gates, Lite's convolution half, the Evolved Transformer's cell)
the block kind says (``tensor_parallel_parts``: :class:`~xscale.models.traits.BlockParts`); the other parts are split
as their own ``parallel_traits`` say, and a parameter no part holds is refused. The embedding
is split by vocabulary and the output projection by vocabulary too, so the loss is vocab-parallel
(:mod:`xscale.parallel.tensor.vocab_parallel`); tied weights stay tied (both are sharded on the vocabulary dim).

Sequence parallelism replaces each all-reduce by a reduce-scatter (after a row-wise projection) and an
all-gather (before a column-wise one): between sub-layers the residual stream, norms, dropout and BERT's
head transform hold T/tp tokens per rank. With an absolute position encoding (learned, sinusoidal) the
embedding output is all-reduced and sliced after the positions are added, since they need the full sequence.
Norms on sequence shards run their own code on local tensors and all-reduce their weight gradients in
backward (torch's ``SequenceParallel`` style would run them through DTensor dispatch and leave Partial
gradients to be reduced later).

Between modules activations are plain local tensors (the whole sequence, or this rank's shard); DTensors
appear only at the boundaries of the split projections. What is not split: MoE layers are replicated over
tp (every tp rank routes the full sequence, under sequence parallelism gathered first), as are norms,
position tables and BERT's head transform; their parameters are Replicate DTensors read as local tensors
(:mod:`xscale.parallel.tensor.replicated`). With n_kv_heads=1 (MQA) the k/v projections are replicated likewise.
Talking-heads attention mixes heads: each rank gathers every head's q and k and computes its own output heads
(:mod:`xscale.parallel.tensor.talking_heads`, which states the extra cost).
An attention core's per-head state (its ``per_head_state``: Gaussian/adaptive-span widths, Synthesizer weights,
pooling points, routing centroids) is split by head like q/k/v (:mod:`xscale.parallel.tensor.head_sharded`).
Every parameter is a DTensor on the tp mesh and every gradient comes back with its parameter's placements.

Dropout masks are functions of each element's global coordinates (:mod:`xscale.models.dropout`), so
replicated activations get the same mask on every rank. The split model is run with a context saying which heads
(and, under sequence parallelism, which tokens of the residual stream) this rank holds
(:func:`tensor_parallel_context`): dropouts draw that slice of the single device's mask, attention cores drop the
probabilities (B, H, Tq, Tk) of their global heads (block-sparse cores mask the gathered blocks at the same global
positions), and per-head position biases (ALiBi, T5) take the rank's heads.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import Attention, AttentionCore
from xscale.models.block import Residual
from xscale.models.registry import ATTENTION, BLOCK, FFN
from xscale.models.stacks import Stack
from xscale.models.traits import traits_of
from xscale.models.transformer import Transformer
from xscale.parallel.tensor.head_sharded import shard_head_state, shard_rows
from xscale.parallel.tensor.replicated import replicate_parameters
from xscale.parallel.tensor.shards import attention_split
from xscale.parallel.tensor.talking_heads import gather_heads
from xscale.parallel.tensor.vocab_parallel import VocabParallelEmbedding
from xscale.runtime import StepContext

# How each attention core's heads are split, by the ``tp`` its parallel_traits declare (xscale.models.traits).
HEAD_SPLITS = {"split_heads": "heads split", "gather_heads": "q and k gathered",
               "head_state": "their per-head state split by head"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _attention_kinds(config: ModelConfig) -> set[str]:
    layers = config.total_layers
    return {config.attention.kind_for_layer(index) for index in range(layers)}


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Refuse a model that ``tp`` ranks cannot split by heads, FFN width and vocabulary (before any build)."""
    if tp < 1:
        raise ConfigError(f"parallel.tp must be >= 1, got {tp}")
    if tp == 1:
        return
    if config.n_heads % tp:
        raise ConfigError(
            f"model.n_heads={config.n_heads} is not divisible by parallel.tp={tp}: tensor parallelism gives each "
            f"rank n_heads/tp heads; pick parallel.tp from {_divisors(config.n_heads)}"
        )
    if config.kv_heads != 1 and config.kv_heads % tp:
        raise ConfigError(
            f"model.n_kv_heads={config.kv_heads} is not divisible by parallel.tp={tp}: each rank needs whole kv "
            f"heads; pick parallel.tp from {_divisors(config.kv_heads)}, or set model.n_kv_heads to a multiple of "
            "tp, or to 1 (MQA: the single kv head is replicated on every rank)"
        )
    layers = config.total_layers
    has_dense_ffn = any(not config.moe.is_moe_layer(index) for index in range(layers))
    if has_dense_ffn and config.ffn_hidden % tp:
        raise ConfigError(
            f"the FFN hidden width {config.ffn_hidden} (model.d_ff) is not divisible by parallel.tp={tp}: "
            f"the FFN is split column-wise; set model.d_ff to a multiple of {tp}"
        )
    if config.vocab_size % tp:
        padded = -(-config.vocab_size // tp) * tp
        raise ConfigError(
            f"model.vocab_size={config.vocab_size} is not divisible by parallel.tp={tp}: the embedding and the "
            f"output projection are split by vocabulary; pad the vocabulary to {padded} (model.vocab_size)"
        )
    if has_dense_ffn and traits_of(FFN.get(config.ffn.kind)).tp != "split_hidden":
        raise ConfigError(f"the feed-forward network model.ffn={config.ffn} declares no column/row-parallel split "
                          "(its parallel_traits), so the tensor-parallel plan refuses it; use parallel.tp=1")
    for kind in sorted(_attention_kinds(config)):
        _check_attention(kind, ATTENTION.get(kind), config)
    block = config.block
    check_block = getattr(BLOCK.get(block.kind), "check_tensor_parallel", None) if block.kind in BLOCK else None
    if check_block is not None:
        check_block(config, BLOCK.options(block, "model.block"), tp)


def _refusal(core: type[AttentionCore]) -> str | None:
    """Why tensor parallelism cannot split ``core`` by heads, read from its declarations (None: it can)."""
    mode = traits_of(core).tp
    if core.mixes_heads and mode != "gather_heads":
        return "mixes information across heads"
    if mode in HEAD_SPLITS:
        return None
    if core.per_head_state:
        return f"keeps per-head state ({', '.join(core.per_head_state)})"
    if core.carries_scores:
        return "passes attention scores between layers"
    return f"declares no head split (its parallel_traits.tp is {mode!r})"


def _split_kinds() -> str:
    """The registered attention kinds tensor parallelism splits, grouped by how (aliases joined by '/')."""
    names: dict[type, list[str]] = {}
    for name in ATTENTION.names():
        names.setdefault(ATTENTION.get(name), []).append(name)
    groups = {mode: sorted("/".join(aliases) for core, aliases in names.items() if traits_of(core).tp == mode
                           and _refusal(core) is None) for mode in HEAD_SPLITS}
    return "; ".join(f"{', '.join(kinds)} ({HEAD_SPLITS[mode]})" for mode, kinds in groups.items() if kinds)


def _check_attention(kind: str, core: type[AttentionCore], config: ModelConfig) -> None:
    why = _refusal(core)
    if why is not None:
        raise ConfigError(f"attention '{kind}' {why}, so the tensor-parallel plan refuses it; use parallel.tp=1 "
                          f"(data/pipeline parallel), or one of the kinds tensor parallelism splits: {_split_kinds()}; "
                          "or declare how its heads split in its parallel_traits (docs/extending.md)")
    for option in traits_of(core).head_dependent_options:
        if config.attention.options.get(option, False):
            raise ConfigError(
                f"attention '{kind}' with model.attention.options.{option}=true gives heads [0, H/2) and "
                f"[H/2, H) different patterns, which tensor parallelism cannot split across ranks; set "
                f"{option}=false (every head sees the union) or parallel.tp=1"
            )


def _stream(sequence_parallel: bool) -> Shard | Replicate:
    """Layout of the residual stream between sub-layers (local tensors: a sequence shard, or all of it)."""
    return Shard(1) if sequence_parallel else Replicate()


def _replicated_projection(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """A projection every rank applies in full (MQA's single kv head) inside a column-parallel region.

    Its input arrives as a Replicate DTensor; each rank's gradient w.r.t. the input and the weights covers
    only its own query heads, so the input gradient is marked Partial (summed with the column-parallel
    projections' in one collective) and the weight gradients are all-reduced.
    """
    replicate_parameters(linear, mesh, sum_gradients=True)

    def local_input(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()])
        return (x, *args[1:])

    linear.register_forward_pre_hook(local_input)


def _parallelize_attention(attention: Attention, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    stream = _stream(sequence_parallel)
    # by the core's config (Lite's attention half: n_heads/2 heads of width d/2); the memory estimator reads it too
    split = attention_split(attention, mesh.size())
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {name: ColwiseParallel() for name in split.column}
    plan.update({name: RowwiseParallel(output_layouts=stream) for name in split.row})
    for name in split.replicated:
        _replicated_projection(getattr(attention, name), mesh)
    parallelize_module(attention, mesh, plan)
    if traits_of(attention.core).tp == "gather_heads":  # every rank gathers all heads' q and k
        gather_heads(attention, mesh, gather_keys=not split.replicated)
    # One DTensor input for q, k, v: their input gradients are summed before the one collective.
    inputs = (stream, None, stream) if attention.cross else (stream, None)
    desired = (Replicate(), None, Replicate()) if attention.cross else (Replicate(), None)
    # Transformer-XL's memory (a keyword, present only with one) is read like the stream: replicated.
    remembered = {} if attention.cross else {"remembered": stream}
    parallelize_module(attention, mesh, PrepareModuleInput(
        input_layouts=inputs, desired_input_layouts=desired, input_kwarg_layouts=remembered,
        desired_input_kwarg_layouts={key: Replicate() for key in remembered}))
    shard_head_state(attention.core, mesh)  # per_head_state: each rank holds its heads' rows
    replicate_parameters(attention.core, mesh, sum_gradients=True)  # per-head use, e.g. Linformer's E, F


def _parallelize_by_traits(module: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """A block's module by its declared traits: its hidden width split (column- then row-parallel linears, with
    the ``split_rows`` that follow the hidden channels), the whole module replicated on the whole sequence (MoE
    layers: every tp rank routes the full sequence), or replicated per token on the stream like a norm."""
    stream = _stream(sequence_parallel)
    traits = traits_of(module)
    if traits.tp == "per_token":
        replicate_parameters(module, mesh, sum_gradients=sequence_parallel)
        return
    if traits.tp == "replicated":
        # Parts that compute on their own swap in their own local tensors (MoE's experts: under ep x ZeRO-3 an
        # FSDP unit inside the layer, whose unshard re-registers DTensors after the layer's swap).
        for name in traits.replicated_parts:
            replicate_parameters(getattr(module, name), mesh, sum_gradients=False)
        replicate_parameters(module, mesh, sum_gradients=False)
        if sequence_parallel:
            parallelize_module(module, mesh, PrepareModuleInputOutput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
        return
    if traits.tp != "split_hidden":
        raise ConfigError(f"no tensor-parallel plan for the module {type(module).__name__} (its parallel_traits.tp "
                          f"is {traits.tp!r}); use parallel.tp=1 or declare its column- and row-parallel linears in "
                          "its parallel_traits (docs/extending.md)")
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {name: ColwiseParallel() for name in traits.column_parallel}
    plan.update({name: RowwiseParallel(output_layouts=stream) for name in traits.row_parallel})
    parallelize_module(module, mesh, plan)
    parallelize_module(module, mesh, PrepareModuleInput(input_layouts=stream, desired_input_layouts=Replicate()))
    shard_rows(module, traits.split_rows, mesh)

def _parallelize_norm(norm: nn.Module | None, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Norms run on whatever the stream holds; on sequence shards each rank's gradient is a partial sum."""
    if norm is not None:
        replicate_parameters(norm, mesh, sum_gradients=sequence_parallel)


def _parallelize_residual(residual: Residual, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    _parallelize_norm(residual.norm, mesh, sequence_parallel)
    _parallelize_norm(getattr(residual, "norm_out", None), mesh, sequence_parallel)
    _parallelize_norm(getattr(residual, "gain", None), mesh, sequence_parallel)  # ReZero's alpha, on the stream


def _parallelize_block(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split what the block kind's ``tensor_parallel_parts()`` names; refuse a parameter none of its parts holds."""
    parts = block.tensor_parallel_parts()
    for path in parts.attentions:
        _parallelize_attention(block.get_submodule(path), mesh, sequence_parallel)
    for path in parts.modules:
        _parallelize_by_traits(block.get_submodule(path), mesh, sequence_parallel)
    for path in parts.residuals:
        _parallelize_residual(block.get_submodule(path), mesh, sequence_parallel)
    holders = dict.fromkeys(name.rpartition(".")[0] or name for name, param in block.named_parameters()
                            if not isinstance(param, DTensor))
    unplanned = [path for path in holders if not any(path.startswith(f"{other}.") for other in holders)]
    if unplanned:
        raise ConfigError(f"the tensor-parallel plan has no split for {', '.join(unplanned)} of a "
                          f"{type(block).__name__} (its tensor_parallel_parts name no module holding them); use "
                          "parallel.tp=1 or name them in the block kind's tensor_parallel_parts")


def _parallelize_embedding(model: Transformer, stacks: list[Stack], mesh: DeviceMesh,
                           sequence_parallel: bool) -> None:
    """Vocab-parallel embedding; under sequence parallelism its output reaches the blocks as sequence shards."""
    adds_positions = any(stack.position is not None and stack.position.adds_to_input for stack in stacks)
    scatter_in_embedding = sequence_parallel and not adds_positions
    output = Shard(1) if scatter_in_embedding else Replicate()
    embedding = model.embedding = VocabParallelEmbedding(model.embedding, mesh, output)
    norm, dropout = model.embedding_norm, model.embedding_dropout
    if sequence_parallel:
        _require_divisible_sequences(embedding, mesh.size())
        if not scatter_in_embedding:
            # Positions are added to the full sequence; the first module after them takes this rank's shard.
            first = norm if norm is not None else dropout
            parallelize_module(first, mesh, PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
    _parallelize_norm(norm, mesh, sequence_parallel)


def _require_divisible_sequences(embedding: nn.Module, tp: int) -> None:
    def check(module: nn.Module, args: tuple) -> None:
        length = args[0].shape[1]
        if length % tp:
            raise ValueError(f"sequence parallelism splits every sequence into tp={tp} equal shards; got length "
                             f"{length}: make train.seq_len (and decoder lengths) a multiple of {tp}")

    embedding.register_forward_pre_hook(check)


def apply_tensor_parallel(model: Transformer | nn.Module, tp_mesh: DeviceMesh, *,
                          sequence_parallel: bool = False) -> None:
    """Split ``model`` (built on the meta device) in place over the 1-D mesh ``tp_mesh``.

    ``model`` is a Transformer or one pipeline stage cut from it (:meth:`Transformer.keep_layers`): the parts it
    holds (embedding, blocks, final norm, head) are split. Then materialise as usual: ``model.to_empty(device=...);
    model.tie_weights(); init_weights(...)``. Under tensor parallelism ``model(...)`` returns logits as a DTensor
    sharded on the vocabulary dim; :func:`xscale.parallel.loss.token_loss_sum` computes the loss from the shards.
    With ``sequence_parallel`` sequence lengths must be multiples of tp.
    """
    if tp_mesh.ndim != 1:
        raise ConfigError(f"apply_tensor_parallel needs the 1-D tp mesh (e.g. mesh['tp']), got a {tp_mesh.ndim}-D "
                          f"mesh with dimensions {tp_mesh.mesh_dim_names}")
    embedding, output = getattr(model, "embedding", None), getattr(model, "output", None)
    if isinstance(embedding, VocabParallelEmbedding) or isinstance(getattr(output, "weight", None), DTensor):
        raise ValueError("apply_tensor_parallel: this model is already tensor-parallel")
    config = model.config
    check_tensor_parallel(config, tp_mesh.size())
    stacks = [stack for stack in (getattr(model, "stack", None), getattr(model, "decoder", None)) if stack is not None]
    if embedding is not None:
        _parallelize_embedding(model, stacks, tp_mesh, sequence_parallel)
    for stack in stacks:
        # The full sequence reaches position tables on every rank; T5's table is read per head.
        if stack.position is not None:  # read by the model's forward (embed) and each attention layer's
            attentions = tuple(attention for block in stack.layers.values()
                               for attention in map(block.get_submodule, block.tensor_parallel_parts().attentions)
                               if not attention.cross)
            per_head_use = stack.position.biases_logits or stack.position.biases_from_content
            replicate_parameters(stack.position, tp_mesh, sum_gradients=per_head_use, used_in=(model, *attentions))
        for block in stack.layers.values():
            _parallelize_block(block, tp_mesh, sequence_parallel)
        _parallelize_norm(stack.final_norm, tp_mesh, sequence_parallel)
    if getattr(model, "head_transform", None) is not None:
        replicate_parameters(model.head_transform, tp_mesh, sum_gradients=sequence_parallel)
    if output is not None:
        parallelize_module(output, tp_mesh, ColwiseParallel(
            input_layouts=_stream(sequence_parallel), output_layouts=Shard(-1), use_local_output=False))
    if embedding is not None and output is not None:
        model.tie_weights()  # the output projection had its own copy of the shared weight sharded


def tensor_parallel_context(tp_mesh: DeviceMesh, sequence_parallel: bool) -> Callable[[StepContext], StepContext]:
    """What a forward of the split model must be told (the trainer's step applies it to every microbatch's context): which
    heads this rank computes, and with sequence parallelism which tokens of the residual stream it holds."""
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()
    return lambda context: context.with_tensor_parallel(rank, size, sequence_parallel)
