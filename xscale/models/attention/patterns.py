"""Position-based sparsity as data: a token rule plus the block layout covering it (Child et al. 2019; Beltagy et al. 2020; Zaheer et al. 2020).

A :class:`Pattern` answers two questions:
  * ``layout(n_query_blocks, n_key_blocks, block, causal)``: a bool tensor (Hp, nqb, nkb), Hp = 1 (shared
    by all heads) or H, True where a query block may see a key block; it must cover every allowed pair;
  * ``allows(head, query, key, block, causal, n_blocks)``: the exact token-level rule, on broadcastable index
    tensors, evaluated by the kernel only inside the blocks the layout selects (``n_blocks`` query = key blocks).
Causality is not part of a pattern: the kernel intersects with ``key <= query``. Patterns compose by ``|``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _block_bounds(n_blocks: int, block: int) -> tuple[Tensor, Tensor]:
    start = torch.arange(n_blocks) * block
    return start, start + block - 1


def _interval_has_multiple(low: Tensor, high: Tensor, step: int) -> Tensor:
    """Whether [low, high] (elementwise) contains a multiple of ``step``."""
    return torch.div(high, step, rounding_mode="floor") * step >= low


class Pattern:
    """Base class; subclasses implement ``layout`` and ``allows``."""

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        raise NotImplementedError

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        raise NotImplementedError

    def __or__(self, other: Pattern) -> Union:
        return Union([self, other])


class Union(Pattern):
    """A query sees a key when any part allows it."""

    def __init__(self, parts: list[Pattern]) -> None:
        self.parts = [q for p in parts for q in (p.parts if isinstance(p, Union) else [p])]

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        layouts = [p.layout(n_query_blocks, n_key_blocks, block, causal) for p in self.parts]
        heads = max(x.shape[0] for x in layouts)
        out = torch.zeros(heads, n_query_blocks, n_key_blocks, dtype=torch.bool)
        for x in layouts:
            out |= x
        return out

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        out = self.parts[0].allows(head, query, key, block, causal, n_blocks)
        for p in self.parts[1:]:
            out = out | p.allows(head, query, key, block, causal, n_blocks)
        return out


class Band(Pattern):
    """Sliding window: |i - j| <= window (causal: the window before i)."""

    def __init__(self, window: int) -> None:
        self.window = window

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        qs, qe = _block_bounds(n_query_blocks, block)
        ks, ke = _block_bounds(n_key_blocks, block)
        gap = torch.maximum(ks[None, :] - qe[:, None], qs[:, None] - ke[None, :]).clamp_min(0)
        return (gap <= self.window)[None]

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return (query - key).abs() <= self.window


class BlockLocal(Pattern):
    """Cut the sequence into chunks of ``size``; attend within the chunk and ``neighbours`` chunks either side."""

    def __init__(self, size: int, neighbours: int = 0) -> None:
        self.size, self.neighbours = size, neighbours

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        qs, qe = _block_bounds(n_query_blocks, block)
        ks, ke = _block_bounds(n_key_blocks, block)
        q_lo, q_hi, k_lo, k_hi = qs // self.size, qe // self.size, ks // self.size, ke // self.size
        gap = torch.maximum(k_lo[None, :] - q_hi[:, None], q_lo[:, None] - k_hi[None, :]).clamp_min(0)
        return (gap <= self.neighbours)[None]

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return (query // self.size - key // self.size).abs() <= self.neighbours


class Strided(Pattern):
    """Every ``stride``-th position: (i - j) mod stride == 0 (Sparse Transformer's strided head)."""

    def __init__(self, stride: int) -> None:
        self.stride = stride

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        qs, qe = _block_bounds(n_query_blocks, block)
        ks, ke = _block_bounds(n_key_blocks, block)
        low, high = qs[:, None] - ke[None, :], qe[:, None] - ks[None, :]
        return _interval_has_multiple(low, high, self.stride)[None]

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return torch.remainder(query - key, self.stride) == 0


class Dilated(Pattern):
    """A window of ``window`` steps with gaps: j = i +- m*dilation, m <= window."""

    def __init__(self, window: int, dilation: int) -> None:
        self.window, self.dilation = window, dilation
        self._cover = Band(window * dilation)
        self._stride = Strided(dilation)

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        return (self._cover.layout(n_query_blocks, n_key_blocks, block, causal)
                & self._stride.layout(n_query_blocks, n_key_blocks, block, causal))

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        distance = (query - key).abs()
        return (distance <= self.window * self.dilation) & (torch.remainder(distance, self.dilation) == 0)


class SummaryColumns(Pattern):
    """Every query sees keys whose position mod ``stride`` is in the last ``width`` (Sparse Transformer 'fixed')."""

    def __init__(self, stride: int, width: int) -> None:
        self.stride, self.width = stride, width

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        positions = torch.arange(n_key_blocks * block)
        summary = (torch.remainder(positions, self.stride) >= self.stride - self.width).view(n_key_blocks, block)
        return summary.any(1)[None, None, :].expand(1, n_query_blocks, n_key_blocks).clone()

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return (torch.remainder(key, self.stride) >= self.stride - self.width) & (query >= 0)


class Global(Pattern):
    """The first ``tokens`` positions are hubs: they see and are seen by every position."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        qs, _ = _block_bounds(n_query_blocks, block)
        ks, _ = _block_bounds(n_key_blocks, block)
        return ((qs < self.tokens)[:, None] | (ks < self.tokens)[None, :])[None]

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return (query < self.tokens) | (key < self.tokens)


class RandomBlocks(Pattern):
    """Each query block sees ``per_block`` key blocks drawn from a seeded generator (causal: from its past).

    The draw depends only on (seed, sizes, causal), so every rank holds the same pattern.
    """

    def __init__(self, per_block: int, seed: int) -> None:
        self.per_block, self.seed = per_block, seed
        self._cache: dict[tuple[int, int, bool], Tensor] = {}
        self._tables: dict[tuple[int, bool, str], Tensor] = {}  # the (n, n) draw on each device ``allows`` ran on

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        key = (n_query_blocks, n_key_blocks, causal)
        if key not in self._cache:
            generator = torch.Generator().manual_seed(self.seed)
            scores = torch.rand(n_query_blocks, n_key_blocks, generator=generator)
            if causal:
                future = torch.arange(n_key_blocks)[None, :] > torch.arange(n_query_blocks)[:, None]
                scores = scores.masked_fill(future, -1.0)
            picks = scores.topk(min(self.per_block, n_key_blocks), dim=1).indices
            chosen = torch.zeros(n_query_blocks, n_key_blocks, dtype=torch.bool).scatter_(1, picks, True)
            self._cache[key] = (chosen & (scores >= 0))[None]
        return self._cache[key]

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        # one copy per device, kept: a compiled kernel reading the rule (FlexAttention's mask_mod) captures it
        place = (n_blocks, causal, str(query.device))
        if place not in self._tables:
            self._tables[place] = self.layout(n_blocks, n_blocks, block, causal)[0].to(query.device)
        return self._tables[place][query // block, key // block]


class SplitHeads(Pattern):
    """Heads [0, H/2) follow ``first``, heads [H/2, H) follow ``second`` (Sparse Transformer's factorised heads)."""

    def __init__(self, first: Pattern, second: Pattern, n_heads: int) -> None:
        self.first, self.second, self.n_heads = first, second, n_heads

    def layout(self, n_query_blocks: int, n_key_blocks: int, block: int, causal: bool) -> Tensor:
        a = self.first.layout(n_query_blocks, n_key_blocks, block, causal)[0]
        b = self.second.layout(n_query_blocks, n_key_blocks, block, causal)[0]
        half = self.n_heads // 2
        return torch.stack([a] * half + [b] * (self.n_heads - half))

    def allows(self, head: Tensor, query: Tensor, key: Tensor, block: int, causal: bool, n_blocks: int) -> Tensor:
        return torch.where(head < self.n_heads // 2, self.first.allows(head, query, key, block, causal, n_blocks),
                           self.second.allows(head, query, key, block, causal, n_blocks))


def reference_mask(pattern: Pattern, length: int, block: int, causal: bool, n_heads: int = 1) -> Tensor:
    """The dense (Hp, T, T) token mask a pattern denotes: the quadratic test reference, never the implementation."""
    head = torch.arange(n_heads)[:, None, None]
    query = torch.arange(length)[None, :, None]
    key = torch.arange(length)[None, None, :]
    mask = pattern.allows(head, query, key, block, causal, -(-length // block)).expand(n_heads, length, length)
    if causal:
        mask = mask & (key <= query)
    return mask
