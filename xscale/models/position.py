"""Position encodings: added to the input, rotated into q/k, added to attention logits, or read with q/k/v.

Every encoding implements the three hooks of :class:`PositionEncoding`; each hook is the identity
unless the method acts there. One module serves a whole stack (T5 and ALiBi share across layers).
Each hook takes the forward's :class:`~xscale.runtime.StepContext`: a rank holding only some positions of each
sequence (context parallelism) finds their global positions there, and the encodings that act at them declare
``cp`` in their ``parallel_traits``. Tensor parallelism replicates every encoding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from xscale.config.schema import Component, ConfigError
from xscale.models.registry import POSITION, NoOptions
from xscale.models.traits import ParallelTraits
from xscale.ops import apply_rope
from xscale.runtime import StepContext
from xscale.runtime.eager import eager_under_compile


class PositionEncoding(nn.Module):
    """Identity at every hook; subclasses override the hook their method uses."""

    adds_to_input = False
    rotates_qk = False
    biases_logits = False
    biases_from_content = False  # content_bias reads q and k (Shaw, Transformer-XL)
    mixes_values = False  # value_term adds to the attention output (Shaw's a^V)

    Options: ClassVar[type] = NoOptions

    def __init__(self, d_model: int, n_heads: int, head_dim: int, max_seq_len: int, causal: bool,
                 options: Any = None) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.max_seq_len, self.causal = max_seq_len, causal
        self.options = self.Options() if options is None else options

    def embed(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        """x: (B, T, D) token embeddings -> with absolute positions added."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor,
               context: StepContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, H, T, hd), k: (B, Hkv, T, hd) -> rotated by position (RoPE)."""
        return q, k

    def bias(self, q_len: int, k_len: int, heads: slice, context: StepContext | None = None) -> torch.Tensor | None:
        """Additive logit bias (len(heads), q_len, k_len) for the given heads, or None. Under a context holding part
        of each sequence: the rows of the queries held here against every key of the whole sequence."""
        return None

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, heads: slice,
                     context: StepContext | None = None) -> torch.Tensor | None:
        """Additive logit bias (B, len(heads), Tq, Tk) that reads q (B, h, Tq, hd) and k (B, Hkv, Tk, hd), on the
        scale of q k^T / sqrt(hd). The queries are the last Tq of the Tk positions (a KV cache holds the rest)."""
        return None

    def value_term(self, probs: torch.Tensor, heads: slice, context: StepContext | None = None) -> torch.Tensor | None:
        """A term (B, h, Tq, hd) added to probs @ v, from the attention probabilities (B, h, Tq, Tk)."""
        return None


def relative_distances(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """j - i (Tq, Tk) for queries at the last ``q_len`` of ``k_len`` positions (all of them without a KV cache)."""
    queries = torch.arange(k_len - q_len, k_len, device=device)
    return torch.arange(k_len, device=device)[None, :] - queries[:, None]


def _held(context: StepContext | None) -> bool:
    """Whether this rank holds only some positions of each sequence (context parallelism)."""
    return context is not None and context.sequence is not None


def _table_rows(table: torch.Tensor, length: int, context: StepContext | None) -> torch.Tensor:
    """The rows of a per-position table for the ``length`` tokens held here (their global positions)."""
    whole = context.sequence_length(length) if _held(context) else length
    if whole > table.shape[0]:
        raise ValueError(f"sequence length {whole} exceeds model.max_seq_len={table.shape[0]}")
    return table.index_select(0, context.positions(length, table.device)) if _held(context) else table[:length]


def _query_rows(bias_of: Callable[[int, int], torch.Tensor], q_len: int, k_len: int,
                context: StepContext | None) -> torch.Tensor:
    """``bias_of(q_len, k_len)``; for a rank holding part of each sequence, the whole sequence's bias at the rows of
    its queries (the keys are gathered whole before attention)."""
    if not _held(context):
        return bias_of(q_len, k_len)
    full = bias_of(context.sequence_length(q_len), context.sequence_length(k_len))
    return full[:, context.positions(q_len, full.device)]


@POSITION.register("none")
class NoPosition(PositionEncoding):
    """No positions (NoPE): a causal decoder infers order from its mask."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)


@POSITION.register("sinusoidal")
class SinusoidalPosition(PositionEncoding):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (Vaswani et al. 2017, sec. 3.5)."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    adds_to_input = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("table", self._table(self.max_seq_len, self.d_model), persistent=False)

    @staticmethod
    def _table(length: int, dim: int) -> torch.Tensor:
        position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
        table = torch.zeros(length, dim, dtype=torch.float64)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
        return table.float()

    def embed(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        return x + _table_rows(self.table, x.shape[1], context).to(x.dtype)

    def reset_buffers(self) -> None:
        self.table = self._table(self.max_seq_len, self.d_model).to(self.table.device)


@POSITION.register("learned")
class LearnedPosition(PositionEncoding):
    """A learned vector per absolute position (GPT-2, BERT)."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    adds_to_input = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight = nn.Parameter(torch.empty(self.max_seq_len, self.d_model))

    def embed(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        return x + _table_rows(self.weight, x.shape[1], context)


@dataclasses.dataclass
class RotaryOptions:
    theta: float = dataclasses.field(default=10000.0, metadata={"help": "the base of the angles pos * theta^(-2i/d)"})

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ConfigError(f"model.position.options.theta must be positive, got {self.theta}")


@POSITION.register("rope")
class RotaryPosition(PositionEncoding):
    """RoPE: rotate feature pairs (i, i + d/2) by angle pos * theta^(-2i/d) (Su et al. 2021, eq. 34)."""

    Options = RotaryOptions
    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    rotates_qk = True
    kernels = "auto"  # the fused-op backend (Transformer.use_kernels)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] < length or self._cache[1] != device:
            inv_freq = 1.0 / (self.options.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                            / self.head_dim))
            angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._cache = (length, device, angles.cos(), angles.sin())
        return self._cache[2][:length], self._cache[3][:length]

    def rotate(self, q: torch.Tensor, k: torch.Tensor,
               context: StepContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if _held(context):  # q and k: the same tokens, at their global positions
            positions = context.positions(q.shape[-2], q.device)
            cos, sin = self._cos_sin(context.sequence_length(q.shape[-2]), q.device)
            cos, sin = cos[positions], sin[positions]
            return apply_rope(q, cos, sin, self.kernels), apply_rope(k, cos, sin, self.kernels)
        # More keys than queries (a segment memory's keys first): the queries are the last of the keys' positions,
        # so q_i . k_j still depends on their distance only.
        q_len, k_len = q.shape[-2], k.shape[-2]
        cos, sin = self._cos_sin(max(q_len, k_len), q.device)
        first = max(k_len - q_len, 0)
        return (apply_rope(q, cos[first:first + q_len], sin[first:first + q_len], self.kernels),
                apply_rope(k, cos[:k_len], sin[:k_len], self.kernels))


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """m_h = 2^(-8h/n) for h = 1..n, with the paper's interleaving when n is not a power of two (Press et al. 2022)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two(closest) + extra)


@POSITION.register("alibi")
class ALiBiPosition(PositionEncoding):
    """ALiBi: add -m_h * |i - j| to the logits of head h (Press et al. 2022)."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    biases_logits = True

    def bias(self, q_len: int, k_len: int, heads: slice, context: StepContext | None = None) -> torch.Tensor:
        slopes = alibi_slopes(self.n_heads)[heads]

        def bias_of(queries: int, keys: int) -> torch.Tensor:
            distance = (torch.arange(keys)[None, :] - torch.arange(queries)[:, None]).abs().float()
            return -slopes[:, None, None] * distance[None]

        return _query_rows(bias_of, q_len, k_len, context)


@dataclasses.dataclass
class T5BiasOptions:
    num_buckets: int = dataclasses.field(default=32, metadata={"help": "relative-distance buckets (half each way "
                                                                       "in an encoder)"})
    max_distance: int = dataclasses.field(default=128, metadata={"help": "distance of the last, log-spaced bucket"})

    def __post_init__(self) -> None:
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 2:
            raise ConfigError(f"model.position.options: t5_bias needs num_buckets >= 4 and max_distance > "
                              f"num_buckets / 2, got num_buckets={self.num_buckets}, max_distance={self.max_distance}")


@POSITION.register("t5_bias")
class T5RelativeBias(PositionEncoding):
    """A learned scalar per head and log-spaced relative-distance bucket (Raffel et al. 2020, sec. 2.1)."""

    Options = T5BiasOptions
    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    biases_logits = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_buckets, self.max_distance = self.options.num_buckets, self.options.max_distance
        self.weight = nn.Parameter(torch.empty(self.num_buckets, self.n_heads))

    def _bucket(self, relative: torch.Tensor) -> torch.Tensor:
        buckets = self.num_buckets
        result = torch.zeros_like(relative)
        if self.causal:
            relative = -torch.clamp(relative, max=0)
        else:
            buckets //= 2
            result = result + (relative > 0).long() * buckets
            relative = relative.abs()
        exact = buckets // 2
        is_small = relative < exact
        large = exact + (
            torch.log(relative.float().clamp_min(1) / exact) / math.log(self.max_distance / exact) * (buckets - exact)
        ).long()
        large = torch.clamp(large, max=buckets - 1)
        return result + torch.where(is_small, relative, large)

    def bias(self, q_len: int, k_len: int, heads: slice, context: StepContext | None = None) -> torch.Tensor:
        device = self.weight.device

        def bias_of(queries: int, keys: int) -> torch.Tensor:
            relative = torch.arange(keys, device=device)[None, :] - torch.arange(queries, device=device)[:, None]
            values = self.weight[self._bucket(relative)]  # (q, k, H)
            return values.permute(2, 0, 1)[heads]

        return _query_rows(bias_of, q_len, k_len, context)


def build_position(position: Component, d_model: int, n_heads: int, head_dim: int, max_seq_len: int,
                   causal: bool) -> PositionEncoding:
    """The encoding ``model.position`` names, with its options."""
    return POSITION.build(position, "model.position", d_model, n_heads, head_dim, max_seq_len, causal)


class _GradientTap(torch.autograd.Function):
    """Identity on ``value``, with an (unused) edge to ``anchor``: see :class:`TappedPosition`."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TappedPosition:
    """A stack's position encoding whose logit bias from a learned table (T5) passes through an identity with an
    edge to ``anchor``, the stack's input when a previous pipeline stage sent it.

    Zero-bubble schedules (Qi et al. 2024) split a stage's backward in two: the input half keeps, for each
    parameter, the gradients at the nodes where the parameter's path joins the input's, and the weight half later
    runs backward from those nodes to the parameter. For a table every block reads, the joining nodes would be the
    blocks' scores, and from block k's scores the way back to the table also runs through the blocks before it
    (which read it too): the weight half would redo the stage's backward on a freed graph. The tap is a joining node
    whose only way back is to the table. Everything else is the wrapped encoding's.
    """

    def __init__(self, position: PositionEncoding, anchor: torch.Tensor) -> None:
        self.position, self.anchor = position, anchor

    @classmethod
    def around(cls, position: PositionEncoding, anchor: torch.Tensor) -> PositionEncoding | TappedPosition:
        """``position`` tapped when a backward will run to ``anchor`` and a learned table feeds the bias."""
        tapping = (anchor.requires_grad and torch.is_grad_enabled() and position.biases_logits
                   and any(param.requires_grad for param in position.parameters()))
        return cls(position, anchor) if tapping else position

    def __getattr__(self, name: str):
        return getattr(self.position, name)

    def bias(self, *args, **kwargs) -> torch.Tensor | None:
        value = self.position.bias(*args, **kwargs)
        return None if value is None else _tap(value, self.anchor)


@eager_under_compile
def _tap(value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """:class:`_GradientTap` applied eagerly, also in a compiled block: traced, the identity was folded away and the
    zero-bubble schedule's weight half missed part of the table's gradient (loss off by 1.6e-4 in 3 steps)."""
    return _GradientTap.apply(value, anchor)
