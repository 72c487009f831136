"""Luna: linear unified nested attention (Ma et al. 2021): pack the sequence into a fixed-length extra sequence
P (length l), then unpack it: Y_P = Attn(P, X) (pack), Y_X = Attn(X, Y_P) (unpack), cost T * l.

Bidirectional: :class:`xscale.models.attention.inducing.PooledAttention` with P as the points (packed keys and
values A K, A V share one pack map A). Causal (our formulation of the paper's autoregressive Luna): position t
unpacks a pack of its own prefix only,
  K~_t = sum_{j<=t} a_pj k_j / sum_{j<=t} a_pj,  a_pj = exp(p . k_j / sqrt(d))  (V~_t alike),
  out_t = softmax(q_t K~_t^T / sqrt(d)) V~_t.
The prefix sums run chunk by chunk with a running maximum (online softmax), so nothing a position computes
depends on a later one. Each chunk holds l * chunk * (chunk + d) values and is recomputed in backward, so
training keeps O(T * d + T/chunk * l * d), at the price of a second forward. The causal form applies no
attention dropout.

Not done: Luna feeds each layer's packed output to the next layer as its P; here P is a learned parameter
of every layer (the chain would be a second stream between blocks, as RealFormer's scores are).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import check_heads, expand_kv
from xscale.models.attention.inducing import PooledAttention
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.runtime import StepContext


def _pack_and_unpack_chunk(q: Tensor, k: Tensor, v: Tensor, points: Tensor, running_max: Tensor,
                           numerator_k: Tensor, numerator_v: Tensor, normaliser: Tensor) -> tuple[Tensor, ...]:
    """One chunk of C positions, given the prefix state before it (numerators (B, H, l, d), normaliser and
    running maximum (B, H, l)); returns (out (B, H, C, d), the state after the chunk)."""
    scale = k.shape[-1] ** -0.5
    size = k.shape[2]
    logits = torch.einsum("hpd,bhsd->bhps", points, k) * scale  # (B, H, l, C)
    # Stabiliser per (point, position): the max over the prefix; it cancels in every ratio.
    shift = torch.maximum(logits.detach().cummax(-1).values, running_max[..., None])
    future = ~torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # [t, s]: s > t
    # Masked before exp: a future logit may exceed the shift and overflow, and 0 * inf in backward is NaN.
    weights = (logits[..., None, :] - shift[..., :, None]).masked_fill(future, float("-inf")).exp()  # (B,H,l,C,C)
    carry = torch.exp(running_max[..., None] - shift)  # (B, H, l, C): rescales the state before the chunk
    sum_k = torch.einsum("bhpts,bhsd->bhptd", weights, k) + carry[..., None] * numerator_k[..., None, :]
    sum_v = torch.einsum("bhpts,bhsd->bhptd", weights, v) + carry[..., None] * numerator_v[..., None, :]
    total = weights.sum(-1) + carry * normaliser[..., None]  # (B, H, l, C)
    packed_k = sum_k / total[..., None]  # (B, H, l, C, d)
    packed_v = sum_v / total[..., None]
    scores = torch.einsum("bhtd,bhptd->bhtp", q, packed_k) * scale  # (B, H, C, l)
    out = torch.einsum("bhtp,bhptd->bhtd", torch.softmax(scores, dim=-1), packed_v)
    # Copies, not views: a view would keep the whole l x C x d chunk tensors alive until backward.
    state = (shift[..., -1], sum_k[..., -1, :], sum_v[..., -1, :], total[..., -1])
    return (out,) + tuple(x.clone() for x in state)


def causal_packed_attention(q: Tensor, k: Tensor, v: Tensor, points: Tensor, chunk: int) -> Tensor:
    """q, k, v (B, H, T, d), points (H, l, d) -> (B, H, T, d), position t packing only positions <= t.

    With gradients on, each chunk is recomputed in backward (activation checkpointing), so what backward keeps
    is the chunk inputs and the (B, H, l, d) state between chunks, not the l x C x (C + d) chunk intermediates.
    """
    batch, heads, length, dim = k.shape
    points = points.to(k.dtype)
    state = (k.new_full((batch, heads, points.shape[1]), float("-inf")),
             k.new_zeros(batch, heads, points.shape[1], dim), k.new_zeros(batch, heads, points.shape[1], dim),
             k.new_zeros(batch, heads, points.shape[1]))
    outputs = []
    for start in range(0, length, chunk):
        inputs = tuple(x[:, :, start:start + chunk] for x in (q, k, v)) + (points,) + state
        if torch.is_grad_enabled():
            out, *state = checkpoint(_pack_and_unpack_chunk, *inputs, use_reentrant=False)
        else:
            out, *state = _pack_and_unpack_chunk(*inputs)
        state = tuple(state)
        outputs.append(out)
    return torch.cat(outputs, dim=2)


@dataclasses.dataclass
class LunaOptions:
    packed_length: int = 16  # l
    chunk: int = 64  # causal: positions per step of the prefix sums

    def __post_init__(self) -> None:
        require_positive("luna", packed_length=self.packed_length, chunk=self.chunk)


@ATTENTION.register("luna")
class LunaAttention(PooledAttention):
    Options = LunaOptions

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return not causal  # the causal form (online-softmax prefix packs) applies none

    def __init__(self, model: ModelConfig, layer_index: int, options: LunaOptions) -> None:
        super().__init__(model, layer_index, options, options.packed_length)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        if not causal:
            return self.pooled(q, k, v, context)
        require(q.shape[2] == k.shape[2], "causal luna attention is self-attention (equal query and key lengths)")
        check_heads(self, self.points, q.shape[1])
        return causal_packed_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), self.points,
                                       self.options.chunk)
