"""Linearized attention: phi(Q) (phi(K)^T V) / phi(Q) sum phi(K) (Katharopoulos et al. 2020, eq. 4-6, phi = elu + 1).

The causal form (eq. 8-9) runs over chunks of C positions: inside a chunk a masked C x C product, across
chunks a running state S = sum phi(k) [v, 1]^T (m x (d + 1): the last column is the normaliser z = sum phi(k))
kept once per chunk, so memory is T/C x m x d, never T x m x d. :func:`kernelized_attention` is shared with the random-feature variants.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import AttentionCore, causal_over_longer_keys, expand_kv
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def kernelized_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk: int,
                         eps: float = 1e-6) -> Tensor:
    """phi_q, phi_k (B, H, T, m) feature maps, v (B, H, T, d) -> (B, H, T, d).

    The values carry an extra column of ones, so one product gives the numerator and (last column) the normaliser.
    """
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, T, d + 1)
    if not causal:
        out = phi_q @ (phi_k.transpose(-1, -2) @ values)
        return out[..., :-1] / out[..., -1:].clamp_min(eps)
    batch, heads, length, _ = phi_q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:
        phi_q, phi_k, values = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, values))
    phi_q, phi_k, values = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1]) for x in (phi_q, phi_k, values))
    out = (phi_q @ phi_k.transpose(-1, -2)).tril_() @ values  # inside each chunk: (B, H, n, C, d + 1)
    if n_chunks > 1:
        # chunk i reads the states of chunks < i: an exclusive prefix sum (B, H, n, m, d + 1), zero for chunk 0
        states = (phi_k.transpose(-1, -2) @ values).narrow(2, 0, n_chunks - 1)
        out = out + phi_q @ F.pad(states, (0, 0, 0, 0, 1, 0)).cumsum(dim=2)
    out = out.reshape(batch, heads, n_chunks * chunk, -1)[:, :, :length]
    return out[..., :-1] / out[..., -1:].clamp_min(eps)


FeatureMap = Callable[[Tensor], Tensor]


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_q: FeatureMap, feature_k: FeatureMap, *, causal: bool,
                     chunk: int, eps: float = 1e-6) -> Tensor:
    """phi(q) (phi(k)^T v) row-normalised, for q, k, v (B, H, T, d); ``feature_q`` / ``feature_k`` map (..., d) to
    (..., m) token by token. Causal: :class:`ChunkedCausalKernel`, which never holds the T x m features."""
    if causal:
        return ChunkedCausalKernel.apply(q, k, v, feature_q, feature_k, chunk, eps)
    return kernelized_attention(feature_q(q), feature_k(k), v, causal=False, chunk=chunk, eps=eps)


def _chunk_forward(q: Tensor, k: Tensor, v: Tensor, state: Tensor, feature_q: FeatureMap, feature_k: FeatureMap,
                   eps: float) -> tuple[Tensor, Tensor]:
    """One chunk of eq. 8-9: (output (B, H, C, d), the state after it) from the state S = sum phi(k) [v, 1]^T
    of the chunks before it (B, H, m, d + 1)."""
    phi_q, phi_k = feature_q(q), feature_k(k)
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    out = (phi_q @ phi_k.transpose(-1, -2)).tril_() @ values + phi_q @ state
    return out[..., :-1] / out[..., -1:].clamp_min(eps), state + phi_k.transpose(-1, -2) @ values


class ChunkedCausalKernel(torch.autograd.Function):
    """Causal kernel attention over chunks of C tokens that saves q, k, v and the running state at every
    segment of ~sqrt(T/C) chunks; the backward walks the chunks in reverse, recomputes each segment's states
    and each chunk's features (with autograd over that chunk alone) and carries dL/dS backwards.
    Memory beyond q, k, v, their gradients and the output: O(sqrt(T/C) x m x d) states and one chunk's features."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, feature_q: FeatureMap, feature_k: FeatureMap, chunk: int,
                eps: float) -> Tensor:
        length = q.shape[2]
        starts = list(range(0, length, chunk))
        segment = max(1, math.isqrt(len(starts)))
        out = v.new_empty(v.shape)
        state, checkpoints = None, []
        for index, start in enumerate(starts):
            parts = [x.narrow(2, start, min(chunk, length - start)) for x in (q, k, v)]
            if state is None:
                state = _zero_state(parts, feature_k)
            if index % segment == 0:
                checkpoints.append(state)
            result, state = _chunk_forward(*parts, state, feature_q, feature_k, eps)
            out.narrow(2, start, result.shape[2]).copy_(result)
        ctx.save_for_backward(q, k, v, *checkpoints)
        ctx.features, ctx.chunk, ctx.eps, ctx.segment = (feature_q, feature_k), chunk, eps, segment
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, *checkpoints = ctx.saved_tensors
        chunk, eps, segment, length = ctx.chunk, ctx.eps, ctx.segment, q.shape[2]
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        starts = list(range(0, length, chunk))
        grad_state = torch.zeros_like(checkpoints[0])
        for first in reversed(range(0, len(starts), segment)):
            spans = [(s, min(chunk, length - s)) for s in starts[first:first + segment]]
            states = [checkpoints[first // segment]]
            with torch.no_grad():
                for start, size in spans[:-1]:
                    parts = [x.narrow(2, start, size) for x in (q, k, v)]
                    states.append(_chunk_forward(*parts, states[-1], *ctx.features, eps)[1])
            for (start, size), state in zip(reversed(spans), reversed(states)):
                inputs = [x.narrow(2, start, size).detach().requires_grad_() for x in (q, k, v)]
                state = state.detach().requires_grad_()
                with torch.enable_grad():
                    result, next_state = _chunk_forward(*inputs, state, *ctx.features, eps)
                    chunk_grads = torch.autograd.grad((result, next_state), (*inputs, state),
                                                      (grad_out.narrow(2, start, size), grad_state))
                for target, grad in zip(grads, chunk_grads[:3]):
                    target.narrow(2, start, size).copy_(grad)
                grad_state = chunk_grads[3]
        return *grads, None, None, None, None


def _zero_state(parts: list[Tensor], feature_k: FeatureMap) -> Tensor:
    """S = 0 (B, H, m, d + 1): m read from the feature map of one key."""
    with torch.no_grad():
        features = feature_k(parts[1].narrow(2, 0, 1)).shape[-1]
    v = parts[2]
    return v.new_zeros(*v.shape[:2], features, v.shape[-1] + 1)


def kernelized_reference(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, eps: float = 1e-6) -> Tensor:
    """The quadratic form of the same kernel attention (test reference): A = phi_q phi_k^T, row-normalised."""
    weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        weights = weights.tril()
    return (weights @ v) / weights.sum(-1, keepdim=True).clamp_min(eps)


@dataclasses.dataclass
class LinearOptions:
    chunk: int = 64

    def __post_init__(self) -> None:
        require_positive("linear", chunk=self.chunk)


@ATTENTION.register("linear")
class LinearAttention(AttentionCore):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020). Causal with more keys than queries (a segment memory):
    the remembered keys and values are a prefix every query sums over, S_i = sum_{j <= M + i} phi(k_j) v_j^T."""

    Options = LinearOptions
    parallel_traits = ParallelTraits(tp="split_heads")
    attends_to_memory = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        chunk = self.options.chunk
        if not causal:
            return kernel_attention(q, k, v, elu_feature, elu_feature, causal=False, chunk=chunk)
        return causal_over_longer_keys(
            lambda q, k, v: kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=chunk), q, k, v)


def elu_feature(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 (eq. 7)."""
    return F.elu(x) + 1
