"""Position encodings: added to the input, rotated into q/k, or added to attention logits.

Every encoding implements the three hooks of :class:`PositionEncoding`; each hook is the identity
unless the method acts there. One module serves a whole stack (T5 and ALiBi share across layers).
Tensor parallelism replicates every encoding; those whose hooks context parallelism re-evaluates at global
positions (:mod:`xscale.parallel.context`) declare ``cp`` in their ``parallel_traits``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.ops import apply_rope


class PositionEncoding(nn.Module):
    """Identity at every hook; subclasses override the hook their method uses."""

    adds_to_input = False
    rotates_qk = False
    biases_logits = False

    def __init__(self, d_model: int, n_heads: int, head_dim: int, max_seq_len: int, causal: bool,
                 rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.max_seq_len, self.causal, self.rope_theta = max_seq_len, causal, rope_theta

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) token embeddings -> with absolute positions added."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, H, T, hd), k: (B, Hkv, T, hd) -> rotated by position (RoPE)."""
        return q, k

    def bias(self, q_len: int, k_len: int, heads: slice) -> torch.Tensor | None:
        """Additive logit bias (len(heads), q_len, k_len) for the given heads, or None."""
        return None


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

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.table.shape[0]:
            raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={self.table.shape[0]}")
        return x + self.table[: x.shape[1]].to(x.dtype)

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

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.weight.shape[0]:
            raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={self.weight.shape[0]}")
        return x + self.weight[: x.shape[1]]


@POSITION.register("rope")
class RotaryPosition(PositionEncoding):
    """RoPE: rotate feature pairs (i, i + d/2) by angle pos * theta^(-2i/d) (Su et al. 2021, eq. 34)."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    rotates_qk = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] < length or self._cache[1] != device:
            inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                            / self.head_dim))
            angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._cache = (length, device, angles.cos(), angles.sin())
        return self._cache[2][:length], self._cache[3][:length]

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(max(q.shape[-2], k.shape[-2]), q.device)
        return apply_rope(q, cos[: q.shape[-2]], sin[: q.shape[-2]]), apply_rope(k, cos[: k.shape[-2]], sin[: k.shape[-2]])


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

    def bias(self, q_len: int, k_len: int, heads: slice) -> torch.Tensor:
        slopes = alibi_slopes(self.n_heads)[heads]
        distance = (torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]).abs().float()
        return -slopes[:, None, None] * distance[None]


@POSITION.register("t5_bias")
class T5RelativeBias(PositionEncoding):
    """A learned scalar per head and log-spaced relative-distance bucket (Raffel et al. 2020, sec. 2.1)."""

    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    biases_logits = True

    def __init__(self, *args, num_buckets: int = 32, max_distance: int = 128, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.empty(num_buckets, self.n_heads))

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

    def bias(self, q_len: int, k_len: int, heads: slice) -> torch.Tensor:
        device = self.weight.device
        relative = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        values = self.weight[self._bucket(relative)]  # (q, k, H)
        return values.permute(2, 0, 1)[heads]


def build_position(name: str, d_model: int, n_heads: int, head_dim: int, max_seq_len: int, causal: bool,
                   rope_theta: float = 10000.0) -> PositionEncoding:
    return POSITION.get(name)(d_model, n_heads, head_dim, max_seq_len, causal, rope_theta=rope_theta)
