"""Position-sparse attention cores: each names a :mod:`patterns` layout and runs it through :mod:`block_sparse`.

local / block_local / dilated (Beltagy et al. 2020), strided / fixed (Child et al. 2019, sec. 4.2),
global, random, longformer (band + global), bigbird (band + global + random, Zaheer et al. 2020),
star (band of 3 + relay, Guo et al. 2019), axial (row + column, Ho et al. 2019).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention import patterns as P
from xscale.models.attention.block_sparse import BlockPlan, block_sparse_attention, build_plan
from xscale.models.attention.core import AttentionCore, causal_over_longer_keys, held_query_positions
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.ops.flex_block_sparse import block_mask_of, flex_attention_with
from xscale.runtime import StepContext


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError naming the option to change when ``condition`` fails."""
    if not condition:
        raise ConfigError(message)


def require_positive(kind: str, **values: int) -> None:
    for name, value in values.items():
        require(value >= 1, f"model.attention.options.{name} must be >= 1 for '{kind}' (got {value})")


def require_non_negative(kind: str, **values: int) -> None:
    for name, value in values.items():
        require(value >= 0, f"model.attention.options.{name} must be >= 0 for '{kind}' (got {value})")


class PatternAttention(AttentionCore):
    """Base for the position-sparse cores: subclasses return their pattern from ``make_pattern``.

    ``sparse_attention`` (``train.sparse_attention``, set by ``Transformer.use_kernels``): ``gather`` runs the
    pattern through :mod:`block_sparse` on every device; ``flex`` runs CUDA tensors through FlexAttention, the
    pattern's block layout as its ``BlockMask`` and its token rule as ``mask_mod`` (the gathered path stays for
    CPU tensors, which FlexAttention cannot train on, and for attention dropout, which it does not have).
    """

    parallel_traits = ParallelTraits(tp="split_heads", cp_positions=True)
    sparse_attention = "gather"

    def __init__(self, model: ModelConfig, layer_index: int, options: Any) -> None:
        super().__init__(model, layer_index, options)
        self.pattern = self.make_pattern()
        self._plans: dict[tuple, tuple[Tensor | None, BlockPlan]] = {}
        self._block_masks: dict[tuple, Any] = {}

    def make_pattern(self) -> P.Pattern:
        raise NotImplementedError

    def plan(self, length: int, causal: bool, n_heads: int, n_kv_heads: int, device: torch.device,
             dtype: torch.dtype, query_positions: Tensor | None = None) -> BlockPlan:
        """The pattern's plan for ``length`` tokens, built once per shape; ``query_positions``: only the query blocks
        holding these positions (context parallelism: this rank's, a tensor its layout keeps for the run)."""
        # keyed by the positions tensor's identity; the entry holds the tensor, so its id is not reused while cached
        key = (length, causal, n_heads, n_kv_heads, str(device), dtype,
               None if query_positions is None else id(query_positions))
        if key not in self._plans:
            if len(self._plans) >= 8:
                self._plans.clear()
            query_blocks = None if query_positions is None else query_positions.cpu() // self.options.block_size
            self._plans[key] = (query_positions, build_plan(self.pattern, length, self.options.block_size, causal,
                                                            n_heads, n_kv_heads, device, dtype,
                                                            query_blocks=query_blocks))
        return self._plans[key][1]

    def block_mask(self, length: int, causal: bool, n_heads: int, device: torch.device):
        """FlexAttention's ``BlockMask`` of the pattern for ``length`` tokens and the ``n_heads`` heads this core
        sees, built once per shape (:func:`xscale.ops.flex_block_sparse.block_mask_of`)."""
        key = (length, causal, n_heads, str(device))
        if key not in self._block_masks:
            if len(self._block_masks) >= 8:
                self._block_masks.clear()
            block = self.options.block_size
            n_blocks = -(-length // block)
            layout = self.pattern.layout(n_blocks, n_blocks, block, causal)
            if causal:
                layout = layout & torch.ones(n_blocks, n_blocks, dtype=torch.bool).tril()
            if layout.shape[0] > 1:
                layout = layout.expand(n_heads, n_blocks, n_blocks)

            def token_rule(head: Tensor, query: Tensor, key: Tensor) -> Tensor:
                return self.pattern.allows(head, query, key, block, causal, n_blocks)

            index = torch.zeros(1, dtype=torch.long, device=device)
            token_rule(index, index, index)  # fills the rule's per-device tables before a kernel captures them
            self._block_masks[key] = block_mask_of(layout, block, length, length, causal, device, token_rule)
        return self._block_masks[key]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        if (positions := held_query_positions(q, k, context)) is not None:  # some of the queries, all the keys
            return self._attend_at(positions, q, k, v, causal, context)
        if q.shape[2] != k.shape[2] and not (causal and self.attends_to_memory):
            raise ValueError(f"position-sparse attention is self-attention: query length {q.shape[2]} "
                             f"!= key length {k.shape[2]}")

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.sparse_attention == "flex" and q.is_cuda and not self.drops_probabilities:
                return flex_attention_with(q, k, v, self.block_mask(q.shape[2], causal, q.shape[1], q.device))
            plan = self.plan(q.shape[2], causal, q.shape[1], k.shape[1], q.device, q.dtype)
            return block_sparse_attention(q, k, v, plan, self.options.block_size, dropout=self.dropout,
                                          context=context)

        return causal_over_longer_keys(attend, q, k, v) if causal else attend(q, k, v)

    def _attend_at(self, positions: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                   context: StepContext | None) -> Tensor:
        """Queries q (B, H, Tq, hd) at global ``positions`` (Tq) of the sequence of k, v (B, Hkv, T, hd): placed in
        a zero (B, H, T, hd), only the query blocks holding them computed (the gathered path, on every device), and
        their rows returned. A block shared with positions held elsewhere computes those rows too, then drops them."""
        batch, heads, _, head_dim = q.shape
        placed = q.new_zeros(batch, heads, k.shape[2], head_dim).index_copy(2, positions, q)
        plan = self.plan(k.shape[2], causal, heads, k.shape[1], q.device, q.dtype, query_positions=positions)
        out = block_sparse_attention(placed, k, v, plan, self.options.block_size, dropout=self.dropout,
                                     context=context)
        return out.index_select(2, positions)


@dataclasses.dataclass
class LocalOptions:
    window: int = 16
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("local", window=self.window, block_size=self.block_size)


@ATTENTION.register("local", "band", "sliding_window")
class LocalAttention(PatternAttention):
    """Keys within ``window`` positions of the query (causal: the ``window`` before it; with a segment memory the
    window reaches back into the remembered keys, positions counted over [memory ; segment])."""

    Options = LocalOptions
    attends_to_memory = True

    def make_pattern(self) -> P.Pattern:
        return P.Band(self.options.window)


@dataclasses.dataclass
class BlockLocalOptions:
    chunk: int = 16
    neighbours: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("block_local", chunk=self.chunk, block_size=self.block_size)
        require_non_negative("block_local", neighbours=self.neighbours)


@ATTENTION.register("block_local")
class BlockLocalAttention(PatternAttention):
    """Chunks of ``chunk`` tokens attend within themselves and ``neighbours`` chunks around (causal: before)."""

    Options = BlockLocalOptions

    def make_pattern(self) -> P.Pattern:
        return P.BlockLocal(self.options.chunk, self.options.neighbours)


@dataclasses.dataclass
class DilatedOptions:
    window: int = 8
    dilation: int = 2
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("dilated", window=self.window, dilation=self.dilation, block_size=self.block_size)


@ATTENTION.register("dilated")
class DilatedAttention(PatternAttention):
    """``window`` keys each side spaced ``dilation`` apart (Longformer's dilated window; with a segment memory it
    reaches back into the remembered keys like ``local``)."""

    Options = DilatedOptions
    attends_to_memory = True

    def make_pattern(self) -> P.Pattern:
        return P.Dilated(self.options.window, self.options.dilation)


@dataclasses.dataclass
class StridedOptions:
    stride: int = 8
    split_heads: bool = False
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("strided", stride=self.stride, block_size=self.block_size)


@ATTENTION.register("strided")
class StridedAttention(PatternAttention):
    """Sparse Transformer strided: the last ``stride`` positions and every ``stride``-th one before
    (``split_heads``: half the heads each, else their union in every head)."""

    Options = StridedOptions
    parallel_traits = ParallelTraits(tp="split_heads", head_dependent_options=("split_heads",), cp_positions=True)

    def make_pattern(self) -> P.Pattern:
        local, strided = P.Band(self.options.stride), P.Strided(self.options.stride)
        if self.options.split_heads:
            return P.SplitHeads(local, strided, self.model_config.n_heads)
        return local | strided


@dataclasses.dataclass
class FixedOptions:
    stride: int = 8
    summary: int = 1
    split_heads: bool = False
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("fixed", stride=self.stride, summary=self.summary, block_size=self.block_size)
        require(self.summary <= self.stride, "model.attention.options.summary must be <= stride for 'fixed'")


@ATTENTION.register("fixed")
class FixedAttention(PatternAttention):
    """Sparse Transformer fixed: own chunk of ``stride`` plus the last ``summary`` positions of every chunk."""

    Options = FixedOptions
    parallel_traits = ParallelTraits(tp="split_heads", head_dependent_options=("split_heads",), cp_positions=True)

    def make_pattern(self) -> P.Pattern:
        own, summary = P.BlockLocal(self.options.stride, 0), P.SummaryColumns(self.options.stride, self.options.summary)
        if self.options.split_heads:
            return P.SplitHeads(own, summary, self.model_config.n_heads)
        return own | summary


@dataclasses.dataclass
class GlobalOptions:
    global_tokens: int = 4
    window: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("global", global_tokens=self.global_tokens, block_size=self.block_size)
        require_non_negative("global", window=self.window)


@ATTENTION.register("global")
class GlobalAttention(PatternAttention):
    """The first ``global_tokens`` positions see and are seen by all (causal: hubs see the past); others also
    see ``window`` neighbours (0: themselves)."""

    Options = GlobalOptions

    def make_pattern(self) -> P.Pattern:
        return P.Global(self.options.global_tokens) | P.Band(self.options.window)


@dataclasses.dataclass
class RandomOptions:
    random_blocks: int = 2
    window: int = 0
    seed: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("random", random_blocks=self.random_blocks, block_size=self.block_size)
        require_non_negative("random", window=self.window)


def layer_seed(seed: int, layer_index: int) -> int:
    """A per-layer seed that every rank derives identically."""
    return seed * 1_000_003 + layer_index


@ATTENTION.register("random")
class RandomAttention(PatternAttention):
    """``random_blocks`` seeded random key blocks per query block (causal: from its past) plus a ``window``."""

    Options = RandomOptions

    def make_pattern(self) -> P.Pattern:
        o = self.options
        return P.RandomBlocks(o.random_blocks, layer_seed(o.seed, self.layer_index)) | P.Band(o.window)


@dataclasses.dataclass
class LongformerOptions:
    window: int = 16
    global_tokens: int = 2
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("longformer", window=self.window, block_size=self.block_size)
        require_non_negative("longformer", global_tokens=self.global_tokens)


@ATTENTION.register("longformer")
class LongformerAttention(PatternAttention):
    """Band of ``window`` + ``global_tokens`` hubs (Beltagy et al. 2020)."""

    Options = LongformerOptions

    def make_pattern(self) -> P.Pattern:
        return P.Band(self.options.window) | P.Global(self.options.global_tokens)


@dataclasses.dataclass
class BigBirdOptions:
    window: int = 16
    global_tokens: int = 2
    random_blocks: int = 2
    seed: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("bigbird", window=self.window, block_size=self.block_size)
        require_non_negative("bigbird", global_tokens=self.global_tokens, random_blocks=self.random_blocks)


@ATTENTION.register("bigbird")
class BigBirdAttention(PatternAttention):
    """Band + global + random blocks (Zaheer et al. 2020); the causal form (random keys from the past) is ours."""

    Options = BigBirdOptions

    def make_pattern(self) -> P.Pattern:
        o = self.options
        parts = [P.Band(o.window), P.Global(o.global_tokens)]
        if o.random_blocks:
            parts.append(P.RandomBlocks(o.random_blocks, layer_seed(o.seed, self.layer_index)))
        return P.Union(parts)


@dataclasses.dataclass
class StarOptions:
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("star", block_size=self.block_size)


@ATTENTION.register("star")
class StarAttention(PatternAttention):
    """Star-Transformer: each token sees its two neighbours and the relay token 0, which sees all (encoder only)."""

    Options = StarOptions
    causal_capable = False

    def make_pattern(self) -> P.Pattern:
        return P.Band(1) | P.Global(1)


@dataclasses.dataclass
class AxialOptions:
    row: int = 8
    block_size: int = 16

    def __post_init__(self) -> None:
        require_positive("axial", row=self.row, block_size=self.block_size)


@ATTENTION.register("axial")
class AxialAttention(PatternAttention):
    """The sequence read as rows of ``row`` tokens: attend along the own row and the own column (Ho et al. 2019)."""

    Options = AxialOptions

    def make_pattern(self) -> P.Pattern:
        return P.BlockLocal(self.options.row, 0) | P.Strided(self.options.row)
