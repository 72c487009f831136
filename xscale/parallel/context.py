"""Context parallelism: every sequence's tokens sharded over the ``cp`` ranks (Llama 3's all-gather attention,
Grattafiori et al. 2024, sec. 3.3.2).

The ranks of one cp group read the same samples; each keeps a slice of every sequence's tokens: the contiguous
slice ``[r T/cp, (r+1) T/cp)``, or with ``parallel.cp_load_balance`` chunks r and 2cp-1-r of 2cp equal chunks,
so that under a causal mask every rank does the same attention work. Everything but attention is per token and
runs on the local slice as it would on one device. Attention keeps its queries local and all-gathers K and V over
the cp group (one collective for both; backward: a reduce-scatter of their gradients, since every rank's queries
read every key), reordered to global token order. What depends on where a token sits uses its GLOBAL position:
the causal mask (local queries against all keys), RoPE, absolute position embeddings (learned, sinusoidal),
ALiBi and T5 biases (the rows of this rank's queries), and dropout masks: the position encodings and every
:class:`~xscale.models.dropout.Dropout` read the rank's global positions from the forward's
:class:`~xscale.runtime.StepContext` (``sequence``: this rank's :class:`SequenceSlice`), so every layout drops
the same elements.

The model stays single-device PyTorch: this module registers a forward pre-hook on each attention core (it
gathers K/V and turns ``causal`` into an explicit mask over global positions); the trainer's step cuts each
microbatch to the rank's tokens (:meth:`SequenceSlice.shard_batch`) and runs the model with the slice in its
context. Each rank's token losses are summed and divided by the global token count, so the losses summed over
dp x cp and the gradients summed over dp x cp (:mod:`xscale.parallel.data`; ZeRO shards over dp_shard x cp) are
one process's.

Collectives are plain blocking ones issued in program order (the forward's all-gather, the backward's
reduce-scatter, on the thread that runs autograd), so every rank issues the same collectives in the same order on
the cp group and no work handle outlives its tensors.

Scope: decoders, encoders and encoder-decoders whose attention cores declare ``cp`` in their parallel_traits
(dense/mha/gqa/mqa) or ``cp_positions`` (the position-sparse cores: local, dilated, longformer, bigbird, ..., which
compute only the query blocks of this rank's global positions against the gathered K/V; the kernel cores linear,
performer, rfa, cosformer, which start each run of this rank's positions from the state of the keys before it) or
``cp_whole_sequence`` (every other kind: each rank all-gathers Q, K and V, runs the core on the whole sequence and
keeps its rows), under any data-parallel layout, under pipeline parallelism (every stage's cores hooked alike; the
pipeline runs the rank's tokens of the batch) and under tensor parallelism (each tp rank's heads gather over the cp
ranks; with sequence parallelism tp rank t holds slice t of the cp rank's tokens). Refused up front
(:func:`check_context_parallel`): an attention kind that declares none of these, and sequence lengths that do not
split into cp (2cp) equal chunks. An encoder-decoder's two stacks are cut alike, each sequence by its own length;
the decoder's cross-attention gathers the encoder memory's K/V as self-attention gathers its own. MoE layers route
each microbatch's whole sequences over the cp group, and under expert parallelism over the ep group's cp groups
(:mod:`xscale.parallel.context_experts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.registry import ATTENTION, POSITION
from xscale.models.traits import traits_of
from xscale.parallel.collectives import all_gather_flat, reduce_scatter_flat
from xscale.parallel.dims import ParallelDims

TOKENS = 1  # the token dim of the batch's (B, T) ids and labels


class SequenceSlice:
    """Which global tokens cp rank ``rank`` holds of each sequence (a :class:`~xscale.runtime.SequenceLayout`)."""

    def __init__(self, cp: int, rank: int, load_balance: bool) -> None:
        self.cp, self.rank, self.load_balance = cp, rank, load_balance
        self._cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    @property
    def chunks(self) -> int:
        """Equal chunks a sequence is cut into: cp, or 2cp when load balanced."""
        return 2 * self.cp if self.load_balance else self.cp

    def global_size(self, local_size: int) -> int:
        return local_size * self.cp

    def positions_of(self, rank: int, length: int, device: torch.device) -> torch.Tensor:
        """Global positions (int64, ascending) of the tokens ``rank`` holds of a sequence of ``length``."""
        key = (rank, length, torch.device(device))
        if key not in self._cache:
            if length % self.chunks:
                how = f"2 x cp = {self.chunks} chunks (load balanced)" if self.load_balance else f"cp={self.cp} slices"
                raise ValueError(f"context parallelism cuts every sequence into {how}; got a sequence of {length} "
                                 f"tokens: make train.seq_len a multiple of {self.chunks} (an encoder-decoder's "
                                 f"encoder inputs and decoder targets must both split: for span corruption choose "
                                 f"train.seq_len so that both lengths of "
                                 f"xscale.data.objectives.span_corruption_lengths do)")
            size = length // self.chunks
            if self.load_balance:
                firsts = (rank * size, (self.chunks - 1 - rank) * size)
                positions = torch.cat([torch.arange(first, first + size) for first in firsts])
            else:
                positions = torch.arange(rank * size, (rank + 1) * size)
            self._cache[key] = positions.to(device)
        return self._cache[key]

    def coordinates(self, local_size: int, device: torch.device) -> torch.Tensor:
        return self.positions_of(self.rank, local_size * self.cp, device)

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens of every sequence of ``batch`` (ids and labels: (B, T) -> (B, T/cp)), each cut by its
        own length (an encoder-decoder's decoder inputs and labels are another length than its encoder inputs)."""
        return {key: value.index_select(TOKENS, self.positions_of(self.rank, value.shape[TOKENS], value.device))
                if value.dim() > TOKENS else value for key, value in batch.items()}

    def global_order(self, length: int, device: torch.device) -> torch.Tensor | None:
        """Index that puts the rank-major gathered tokens in global order (None: they already are)."""
        if not self.load_balance:
            return None
        gathered = torch.cat([self.positions_of(rank, length, device) for rank in range(self.cp)])
        return torch.argsort(gathered)


class _GatherSequence(torch.autograd.Function):
    """(2, B, H, T/cp, hd) stacked K and V -> (2, B, H, T, hd) in global token order: all-gather over the cp
    group; backward reduce-scatters the gradients (each rank's share summed over every rank's queries)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, cp: int,
                order: torch.Tensor | None) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.order = group, cp, order
        local = local.contiguous()
        gathered = local.new_empty((cp, *local.shape))
        all_gather_flat(gathered.view(-1), local.view(-1), group=group)
        two, batch, heads, length, dim = local.shape
        full = gathered.permute(1, 2, 3, 0, 4, 5).reshape(two, batch, heads, cp * length, dim)
        return full if order is None else full.index_select(3, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.order is not None:  # back to rank-major order: gathered[g] = full[order^-1[g]]
            grad = grad.index_select(3, torch.argsort(ctx.order))
        two, batch, heads, length, dim = grad.shape
        per_rank = grad.reshape(two, batch, heads, ctx.cp, length // ctx.cp, dim).permute(3, 0, 1, 2, 4, 5)
        per_rank = per_rank.contiguous()
        local = grad.new_empty(per_rank.shape[1:])
        reduce_scatter_flat(local.view(-1), per_rank.view(-1), group=ctx.group)
        return local, None, None, None


def gather_sequence(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                    layout: SequenceSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V (B, Hkv, T/cp, hd) -> the whole sequence's (B, Hkv, T, hd), in global order."""
    order = layout.global_order(k.shape[2] * layout.cp, k.device)
    full = _GatherSequence.apply(torch.stack([k, v]), group, layout.cp, order)
    return full[0], full[1]


def _causal_mask(query_positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(Tq, T) additive mask: 0 where key j <= the query's global position, -inf elsewhere."""
    keys = torch.arange(length, device=query_positions.device)
    blocked = keys[None, :] > query_positions[:, None]
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(blocked, float("-inf"))


def _shard_attention_core(core: nn.Module, group: dist.ProcessGroup, layout: SequenceSlice) -> None:
    """Before the core runs: gather K/V, and replace ``causal`` by the mask of this rank's global query positions
    (the core then runs unmasked with that bias, as its own code: dense attention adds it to the logits). A core
    that places its queries itself (``cp_positions``) gets the gathered K/V and ``causal`` as it was."""
    places_queries = traits_of(core).cp_positions

    def gather(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q, k, v = args
        k, v = gather_sequence(k, v, group, layout)
        if places_queries:
            return (q, k, v), kwargs
        bias = kwargs.get("bias")
        if kwargs.get("causal", False):
            mask = _causal_mask(layout.coordinates(q.shape[2], q.device), k.shape[2], q.dtype)
            bias = mask if bias is None else bias + mask
        return (q, k, v), {**kwargs, "causal": False, "bias": bias}

    core.register_forward_pre_hook(gather, with_kwargs=True)


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup, layout: SequenceSlice) -> torch.Tensor:
    """Every rank's (B, H, T/cp, hd) rows -> the whole sequence's (B, H, T, hd) in global order; a (B, H, T/cp, 0)
    placeholder (heads a core does not read) becomes a placeholder of the whole length."""
    length = x.shape[2] * layout.cp
    if x.shape[-1] == 0:
        return x.new_empty(*x.shape[:2], length, 0)
    return _GatherSequence.apply(x.unsqueeze(0), group, layout.cp, layout.global_order(length, x.device))[0]


def _run_on_whole_sequence(core: nn.Module, group: dist.ProcessGroup, layout: SequenceSlice) -> None:
    """A ``cp_whole_sequence`` core: before it runs, gather Q, K and V (K is Q for a core that shares them) and the
    rows of a position encoding's logit bias, and take the layout out of its context (it then masks and drops as on
    one device); after, keep this rank's rows."""

    def gather(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q, k, v = args
        bias = kwargs.get("bias")
        if bias is not None:  # (H, Tq, Tk) or (B, H, Tq, Tk): this rank's query rows -> every row
            rows = bias if bias.dim() == 4 else bias.unsqueeze(0)
            whole = gather_tokens(rows, group, layout)
            kwargs = {**kwargs, "bias": whole if bias.dim() == 4 else whole.squeeze(0)}
        whole_q = gather_tokens(q, group, layout)
        if k is q:
            whole_k, whole_v = whole_q, gather_tokens(v, group, layout)
        elif k.shape == v.shape:
            whole_k, whole_v = gather_sequence(k, v, group, layout)
        else:
            whole_k, whole_v = gather_tokens(k, group, layout), gather_tokens(v, group, layout)
        context = kwargs.get("context")
        return (whole_q, whole_k, whole_v), {**kwargs, "context": None if context is None else
                                                 context.with_sequence(None)}

    def keep_rows(module: nn.Module, args: tuple, kwargs: dict, output):
        out = output[0] if isinstance(output, tuple) else output
        mine = out.index_select(2, layout.coordinates(out.shape[2] // layout.cp, out.device))
        return (mine, *output[1:]) if isinstance(output, tuple) else mine

    core.register_forward_pre_hook(gather, with_kwargs=True)
    core.register_forward_hook(keep_rows, with_kwargs=True)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, *, load_balance: bool = False) -> SequenceSlice:
    """Shard ``model`` (meta or materialised) over the 1-D mesh ``cp_mesh`` in place; returns this rank's slice,
    which cuts each microbatch (``shard_batch``) and goes in every forward's context (``with_sequence``)."""
    if cp_mesh.ndim != 1:
        raise ConfigError(f"apply_context_parallel needs the 1-D cp mesh (e.g. mesh['cp']), got a {cp_mesh.ndim}-D "
                          f"mesh with dimensions {cp_mesh.mesh_dim_names}")
    check_context_parallel_model(model.config, cp_mesh.size())
    layout = SequenceSlice(cp_mesh.size(), cp_mesh.get_local_rank(), load_balance)
    group = cp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, Attention):
            if traits_of(module.core).cp_whole_sequence:
                _run_on_whole_sequence(module.core, group, layout)
            else:
                _shard_attention_core(module.core, group, layout)
    return layout


# ---------------------------------------------------------------------------------------------------- refusals
def _attention_kinds(model: ModelConfig) -> set[str]:
    return {model.attention.kind_for_layer(index) for index in range(model.n_layers)}


def whole_sequence_kinds(model: ModelConfig) -> list[str]:
    """The model's attention kinds that context parallelism runs on the whole sequence on every rank."""
    return sorted(kind for kind in _attention_kinds(model) if traits_of(ATTENTION.get(kind)).cp_whole_sequence)


def _served(kind: str) -> bool:
    traits = traits_of(ATTENTION.get(kind))
    return traits.cp or traits.cp_positions or traits.cp_whole_sequence


def check_context_parallel_model(model: ModelConfig, cp: int) -> None:
    """Refuse a model whose attention or positions the all-gather plan does not shard."""
    for kind in sorted(_attention_kinds(model)):
        if not _served(kind):
            served = [name for name in ATTENTION.names() if _served(name)]
            raise ConfigError(f"attention '{kind}' is not sharded by context parallelism (parallel.cp={cp}): only "
                              f"{', '.join(served)} all-gather over the cp ranks (their parallel_traits declare "
                              "cp, cp_positions or cp_whole_sequence); use one of them (model.attention.kind) or "
                              "parallel.cp=1")
    if not traits_of(POSITION.get(model.position.kind)).cp:
        served = [name for name in POSITION.names() if traits_of(POSITION.get(name)).cp]
        raise ConfigError(f"model.position={model.position} has no context-parallel plan (its parallel_traits do not "
                          f"declare cp); use one of {', '.join(served)} or parallel.cp=1")


def check_context_parallel(config: Config, dims: ParallelDims) -> None:
    """Every refusal of ``parallel.cp > 1`` that needs only the degrees and the config (ParallelDims.validate)."""
    cp, parallel = dims.cp, config.parallel
    check_context_parallel_model(config.model, cp)
    chunks = 2 * cp if parallel.cp_load_balance else cp
    if config.train.seq_len % chunks:
        how = (f"2 x cp = {chunks} chunks (parallel.cp_load_balance=true)" if parallel.cp_load_balance
               else f"cp={cp} equal slices")
        raise ConfigError(f"context parallelism cuts every sequence into {how}; make train.seq_len="
                          f"{config.train.seq_len} a multiple of {chunks}")
