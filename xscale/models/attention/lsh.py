"""Reformer LSH attention (Kitaev et al. 2020, sec. 2): shared QK, h(x) = argmax([xR; -xR]), sort by bucket,
attend within chunks (own + previous), several hash rounds combined by their softmax normalisers.

:func:`bucketed_attention` is the sort-and-chunk kernel, shared with the Routing Transformer. A query sees
keys of its own bucket in its chunk and the previous one; it sees itself only when nothing else is allowed
(the self logit is replaced by a large negative number). Causal: keys at earlier positions, and at most
``chunk`` sorted slots back, so that which keys a query sees never depends on later tokens (sorted slots
within a bucket are ordered by position; slots in other buckets do not count).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import layer_seed, require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext

SELF_LOGIT = -1e5  # Reformer's value for attending to oneself


def _with_previous_chunk(x: Tensor) -> Tensor:
    """(B, H, n, c, ...) -> (B, H, n, 2c, ...): each chunk preceded by the previous one (chunk 0 by the last)."""
    return torch.cat([x.roll(1, dims=2), x], dim=3)


def bucketed_attention(qk: Tensor, v: Tensor, buckets: Tensor, *, chunk: int, causal: bool) -> tuple[Tensor, Tensor]:
    """qk (B, H, T, d) shared queries/keys, v (B, H, T, d), buckets (B, H, T) ints -> (out, logsumexp (B, H, T))."""
    batch, heads, length, dim = qk.shape
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk
    pad = padded - length
    qk, v = F.pad(qk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    sentinel = int(buckets.max()) + 1 if buckets.numel() else 0
    buckets = F.pad(buckets, (0, pad), value=sentinel)  # padding sorts last
    position = torch.arange(padded, device=qk.device)
    order = torch.argsort(buckets * padded + position, dim=-1)  # (B, H, Tp): sorted slot -> position
    inverse = torch.argsort(order, dim=-1)

    def sort(x: Tensor) -> Tensor:
        return x.gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1]))

    def chunks(x: Tensor) -> Tensor:
        return x.reshape(batch, heads, n_chunks, chunk, *x.shape[3:])

    sorted_qk, sorted_v = sort(qk), sort(v)
    sorted_bucket = buckets.gather(2, order)
    queries = chunks(sorted_qk)
    keys = _with_previous_chunk(chunks(F.normalize(sorted_qk, dim=-1)))
    values = _with_previous_chunk(chunks(sorted_v))
    q_pos, q_bucket = chunks(order)[..., :, None], chunks(sorted_bucket)[..., :, None]
    k_pos, k_bucket = _with_previous_chunk(chunks(order))[..., None, :], _with_previous_chunk(chunks(sorted_bucket))[..., None, :]

    scores = queries @ keys.transpose(-1, -2) * dim**-0.5  # (B, H, n, c, 2c)
    allowed = (k_bucket == q_bucket) & (k_pos < length)
    if causal:
        slot = chunks(position.expand(batch, heads, padded))  # sorted slot index
        q_slot = slot[..., :, None]
        k_slot = _with_previous_chunk(slot)[..., None, :]
        allowed = allowed & (k_pos <= q_pos) & (q_slot - k_slot <= chunk)
    scores = scores.masked_fill(k_pos == q_pos, SELF_LOGIT).masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    scores = torch.where(has_key, scores, 0.0)
    logsumexp = torch.where(has_key.squeeze(-1), scores.logsumexp(-1), float("-inf"))
    out = torch.where(has_key, torch.softmax(scores, dim=-1), 0.0) @ values  # (B, H, n, c, d)

    def unsort(x: Tensor) -> Tensor:
        x = x.reshape(batch, heads, padded, -1)
        return x.gather(2, inverse[..., None].expand(-1, -1, -1, x.shape[-1]))[:, :, :length]

    return unsort(out), unsort(logsumexp.unsqueeze(-1)).squeeze(-1)


def combine_rounds(outputs: list[Tensor], logsumexps: list[Tensor]) -> Tensor:
    """Weight each round's output by its share of the total softmax mass (Reformer, sec. 2, multi-round)."""
    if len(outputs) == 1:
        return outputs[0]
    lse = torch.stack(logsumexps)  # (R, B, H, T)
    weights = torch.softmax(lse, dim=0)
    return (torch.stack(outputs) * weights[..., None]).sum(0)


@dataclasses.dataclass
class LSHOptions:
    buckets: int = 4
    rounds: int = 2
    chunk: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive("lsh", buckets=self.buckets, rounds=self.rounds, chunk=self.chunk)
        require(self.buckets == 1 or self.buckets % 2 == 0,
                f"model.attention.options.buckets must be 1 or even for 'lsh' (got {self.buckets})")


@ATTENTION.register("lsh", "reformer")
class LSHAttention(AttentionCore):
    """Angular LSH with ``buckets`` buckets, ``rounds`` hash rounds, chunks of ``chunk`` sorted slots."""

    Options = LSHOptions
    shares_qk = True
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # its bucketed attention applies no dropout

    def __init__(self, model: ModelConfig, layer_index: int, options: LSHOptions) -> None:
        super().__init__(model, layer_index, options)
        half = max(options.buckets // 2, 1)
        self.register_buffer("rotations", torch.empty(options.rounds, model.head_dim, half))
        if self.rotations.device.type != "meta":
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        generator = torch.Generator().manual_seed(layer_seed(self.options.seed, self.layer_index))
        self.rotations.copy_(torch.randn(self.rotations.shape, generator=generator))

    def hash(self, x: Tensor, round_index: int) -> Tensor:
        if self.options.buckets == 1:
            return torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        rotated = x @ self.rotations[round_index].to(x.dtype)
        return torch.cat([rotated, -rotated], dim=-1).argmax(-1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        require(q.shape[2] == k.shape[2], "lsh attention is self-attention with shared queries and keys")
        v = expand_kv(v, q.shape[1])
        outputs, logsumexps = [], []
        for round_index in range(self.options.rounds):
            buckets = self.hash(q.detach(), round_index)
            out, lse = bucketed_attention(q, v, buckets, chunk=self.options.chunk, causal=causal)
            outputs.append(out)
            logsumexps.append(lse)
        return combine_rounds(outputs, logsumexps)
