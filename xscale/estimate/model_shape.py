"""What the cost model needs to know of a model, read once from the model built on the meta device: each block's
parameters (held, and those a token multiplies by), its experts, its attention reach, and the embedding and head.

A block's forward FLOPs per token (Kaplan et al. 2020, sec. 2.1): 2 per parameter a token uses (a MoE layer's
``experts_per_token`` experts, at their capacity factor when the router pads to a capacity) plus 4 x keys x d for the
attention scores and values, keys the positions a query reads (:func:`keys_per_query`), and as much again with T keys
for a decoder block's cross-attention.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from xscale.config.schema import Config, ModelConfig
from xscale.models import build_model
from xscale.models.parameters import count_parameters, experts_per_token
from xscale.parallel.data import is_expert_parameter
from xscale.parallel.tensor.shards import parameter_shards

GLU_FFNS = ("swiglu", "geglu", "reglu")
# Cores whose cost grows with a window, not the sequence (their ``window`` option; docs/planning.md).
WINDOWED_KINDS = ("local", "band", "sliding_window", "dilated", "longformer", "bigbird")


def keys_per_query(model: ModelConfig, layer_index: int, seq_len: int) -> float:
    """Keys a query multiplies with: a windowed core's window (each side without a causal mask), else the whole
    sequence, half of it on average under a causal mask (the masked blocks a fused kernel skips)."""
    causal = model.family == "decoder" or (model.family == "encoder_decoder" and layer_index >= model.n_layers)
    kind = model.attention.kind_for_layer(layer_index % max(model.n_layers, 1))
    window = model.attention.options.get("window") if kind in WINDOWED_KINDS else None
    if window:
        return float(min(seq_len, window if causal else 2 * window + 1))
    return seq_len / 2 if causal else float(seq_len)


@dataclass(frozen=True)
class BlockShape:
    """One block: parameters ``held``, ``used`` per token (experts at their share: ``expert_used`` of them),
    ``expert`` weights held, whether it is a MoE layer, its attention keys per query and a cross-attention's (0:
    none)."""

    held: int
    used: float
    expert: int
    expert_used: float
    moe: bool
    keys: float
    cross_keys: float

    def forward_flops_per_token(self, d_model: int) -> float:
        """2 x used + 4 x keys x d (+ 4 x cross keys x d) (module docstring)."""
        return 2.0 * self.used + 4.0 * (self.keys + self.cross_keys) * d_model


@dataclass(frozen=True)
class OutsideBlocks:
    """Parameters outside the blocks, by where a pipeline stage keeps them (:meth:`Transformer.keep_layers
    <xscale.models.transformer.Transformer.keep_layers>`, :meth:`Stack.keep <xscale.models.stacks.stack.Stack.keep>`):
    ``embedding`` (with its norm) on a stage that starts a stack; per stack (the encoder or only stack, then an
    encoder-decoder's decoder) an absolute position table where it ``starts``, its final norm where it ``ends``, the
    rest (a relative position table) ``anywhere`` it runs; the ``head`` (head transform, untied output, classifier,
    exits, objective head) where the last stack ends, with a copy of a tied embedding when that stage embeds
    nothing."""

    embedding: int = 0
    starts: tuple[int, ...] = (0, 0)
    ends: tuple[int, ...] = (0, 0)
    anywhere: tuple[int, ...] = (0, 0)
    head: int = 0


@dataclass(frozen=True)
class TensorParallelReplicated:
    """The non-expert parameters that the tensor-parallel plan leaves whole on every tp rank
    (:func:`~xscale.parallel.tensor.shards.parameter_shards`), by where they sit: in each block (its norms, GTrXL's
    gates, ...) and outside the blocks (norms, position tables, the head transform), as :class:`OutsideBlocks`."""

    blocks: tuple[int, ...]
    outside: OutsideBlocks = OutsideBlocks()


@dataclass(frozen=True)
class ModelShape:
    """The model as the cost model sees it (module docstring); ``embedding`` the token table, ``head`` the output
    projection's weights (a tied head's too: it is a matmul), ``outside`` final norms and head transform,
    ``model_flops_per_token`` the 6N + 12 L T d of MFU (PaLM, Chowdhery et al. 2022, app. B)."""

    config: Config
    blocks: tuple[BlockShape, ...]
    embedding: int
    head: int
    outside: int
    tied: bool
    largest_parameter: int
    total_parameters: int
    expert_parameters: int
    model_flops_per_token: float
    outside_blocks: OutsideBlocks = OutsideBlocks()
    meta: nn.Module | None = field(default=None, compare=False, repr=False)  # the model on the meta device
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # what the search asks again and again

    def tp_replicated(self, tp: int) -> TensorParallelReplicated:
        """:class:`TensorParallelReplicated` over ``tp`` ranks (none at tp=1: nothing is split)."""
        key = ("tp replicated", tp)
        if key not in self.memo:
            self.memo[key] = _tp_replicated(self.meta, self.model, tp)
        return self.memo[key]

    def distinct_blocks(self, blocks: tuple[int, ...]) -> tuple[tuple[BlockShape, int], ...]:
        """The distinct shapes among ``blocks`` with how many of them each (a rank's sums, done once per shape)."""
        key = ("distinct", blocks)
        if key not in self.memo:
            self.memo[key] = tuple(Counter(self.blocks[index] for index in blocks).items())
        return self.memo[key]

    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def seq_len(self) -> int:
        return self.config.train.seq_len

    @property
    def global_batch(self) -> int:
        return self.config.train.global_batch_size

    @property
    def glu(self) -> bool:
        return self.model.ffn.kind in GLU_FFNS

    @property
    def expert_share(self) -> float:
        """The share of a layer's experts one token runs through, padded to capacity (module docstring)."""
        moe = self.model.moe
        return experts_per_token(moe) * capacity_share(self.config) / moe.num_experts if moe.num_experts else 0.0


def capacity_share(config: Config) -> float:
    """Expert compute per routed token: the capacity factor when a token-choice router pads each expert to its
    capacity (expert choice's is in :func:`experts_per_token` already), 1 when dropless."""
    moe = config.model.moe
    if moe.dropless or moe.router.kind == "expert_choice":
        return 1.0
    return max(moe.capacity_factor, 1.0)


def model_shape(config: Config) -> ModelShape:
    """Read :class:`ModelShape` off the meta-device model (no memory)."""
    model = config.model
    meta = build_model(model, materialize=False)
    moe = model.moe
    share = experts_per_token(moe) * capacity_share(config) / moe.num_experts if moe.num_experts else 0.0
    layers = model.total_layers
    held, used, expert = [0] * layers, [0.0] * layers, [0] * layers
    outside = largest = 0
    kept = _OutsideCounter(meta)
    for name, param in meta.named_parameters():
        largest = max(largest, param.numel())
        index = _block_index(name, model)
        if index is not None:
            is_expert = ".experts." in name
            held[index] += param.numel()
            used[index] += param.numel() * (share if is_expert else 1.0)
            expert[index] += param.numel() if is_expert else 0
            continue
        kept.add(name, param.numel())
        if name != "embedding.weight" and not name.startswith("output.") and ".position." not in name:
            outside += param.numel()
    if model.share_layers:  # one block run at every depth: each depth costs the first block's FLOPs
        used = [used[0] if index < model.n_layers else used[model.n_layers] for index in range(layers)]
    seq = config.train.seq_len
    blocks = tuple(
        BlockShape(held[index], used[index], expert[index], expert[index] * share, expert[index] > 0, keys_per_query(model, index, seq),
                   float(seq) if model.family == "encoder_decoder" and index >= model.n_layers else 0.0)
        for index in range(layers))
    count = count_parameters(config)
    head = model.vocab_size * model.d_model if model.num_classes == 0 else model.num_classes * model.d_model
    flops = 6.0 * count.matmul_per_token + 12.0 * layers * seq * model.d_model
    return ModelShape(config, blocks, model.vocab_size * model.d_model, head, outside, count.tied_head > 0, largest,
                      count.total, count.expert, flops, kept.counts(), meta)


def _block_index(name: str, model: ModelConfig) -> int | None:
    """The index (encoder layers, then decoder layers) of the block holding parameter ``name``; None outside them."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] in ("stack", "decoder") and parts[1] == "layers":
        return int(parts[2]) + (model.n_layers if parts[0] == "decoder" else 0)
    return None


def _tp_replicated(meta: nn.Module, model: ModelConfig, tp: int) -> TensorParallelReplicated:
    blocks = [0] * model.total_layers
    if tp == 1:
        return TensorParallelReplicated(tuple(blocks))
    shards = parameter_shards(meta, tp)
    kept = _OutsideCounter(meta)
    for name, param in meta.named_parameters():
        if shards[name] is not None or is_expert_parameter(name):
            continue
        index = _block_index(name, model)
        if index is None:
            kept.add(name, param.numel())
        else:
            blocks[index] += param.numel()
    return TensorParallelReplicated(tuple(blocks), kept.counts())


HEAD_MODULES = ("head_transform", "output", "classifier", "exits", "objective_head")


class _OutsideCounter:
    """Sums the parameters outside the blocks into :class:`OutsideBlocks`, by their module's name."""

    def __init__(self, meta) -> None:
        stacks = [getattr(meta, name, None) for name in ("stack", "decoder")]
        self.adds_to_input = {name: stack is not None and stack.position is not None and stack.position.adds_to_input
                              for name, stack in zip(("stack", "decoder"), stacks)}
        self.embedding = self.head = 0
        self.starts, self.ends, self.anywhere = [0, 0], [0, 0], [0, 0]

    def add(self, name: str, count: int) -> None:
        parts = name.split(".")
        if parts[0] in ("embedding", "embedding_norm"):
            self.embedding += count
        elif parts[0] in HEAD_MODULES:
            self.head += count
        elif parts[0] in ("stack", "decoder"):
            index = 0 if parts[0] == "stack" else 1
            if parts[1] == "final_norm":
                self.ends[index] += count
            elif parts[1] == "position" and self.adds_to_input[parts[0]]:
                self.starts[index] += count
            else:
                self.anywhere[index] += count
        else:  # a module of the model that no stage deletes
            self.anywhere[0] += count

    def counts(self) -> OutsideBlocks:
        return OutsideBlocks(self.embedding, tuple(self.starts), tuple(self.ends), tuple(self.anywhere), self.head)
