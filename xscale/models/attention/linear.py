"""Linearized attention: phi(Q) (phi(K)^T V) / phi(Q) sum phi(K) (Katharopoulos et al. 2020, eq. 4-6, phi = elu + 1).

The causal form (eq. 8-9) runs over chunks of C positions: inside a chunk a masked C x C product, across
chunks a prefix sum of the chunk states S = sum phi(k) [v, 1]^T (m x (d + 1): the last column is the normaliser
z = sum phi(k)); :class:`ChunkedCausalKernel` takes it a segment of chunks at a time, so memory stays
O(sqrt(T C) x m), never T x m. :func:`kernelized_attention` is shared with the random-feature variants.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.core import (
    AttentionCore,
    causal_over_longer_keys,
    expand_kv,
    held_query_positions,
)
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
    if causal:
        out = causal_chunks(phi_q, phi_k, values, chunk)[0]
    else:
        out = phi_q @ (phi_k.transpose(-1, -2) @ values)
    return out[..., :-1] / out[..., -1:].clamp_min(eps)


def kernelized_attention_at(positions: Tensor, phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk: int,
                            eps: float = 1e-6) -> Tensor:
    """:func:`kernelized_attention` for queries at the global ``positions`` (Tq, ascending) of the sequence of phi_k,
    v (context parallelism: this rank's queries, every rank's keys): causal, each run of consecutive positions [a, b)
    from the state phi_k[:a]^T [v[:a], 1] of the keys before it, then eq. 8-9 over its own keys."""
    if not causal:
        return kernelized_attention(phi_q, phi_k, v, causal=False, chunk=chunk, eps=eps)
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)

    def attend_run(first: int, start: int, size: int) -> Tensor:
        state = phi_k.narrow(2, 0, start).transpose(-1, -2) @ values.narrow(2, 0, start) if start else None
        return causal_chunks(phi_q.narrow(2, first, size), phi_k.narrow(2, start, size),
                             values.narrow(2, start, size), chunk, state)[0]

    out = over_runs(positions, attend_run)
    return out[..., :-1] / out[..., -1:].clamp_min(eps)


def causal_chunks(phi_q: Tensor, phi_k: Tensor, values: Tensor, chunk: int,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 8-9 unnormalised over chunks of ``chunk`` positions, every chunk at once: (phi_q (B, H, T, m),
    phi_k, values (B, H, T, e)) -> (sum_{j <= i} phi_q_i . phi_k_j values_j (B, H, T, e), the state after the
    last position). ``state`` (B, H, m, e): sum phi(k) values^T of the positions before these (None: none)."""
    batch, heads, length, _ = phi_q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # zero features: the padded keys add nothing to any state
        phi_q, phi_k, values = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, values))
    phi_q, phi_k, values = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1]) for x in (phi_q, phi_k, values))
    out = (phi_q @ phi_k.transpose(-1, -2)).tril_() @ values  # inside each chunk: (B, H, n, C, e)
    chunk_states = phi_k.transpose(-1, -2) @ values  # (B, H, n, m, e)
    before = prefix_sums(chunk_states[:, :, :-1], state)  # chunk i reads the state and the chunks < i
    out = _add_product(out, phi_q, before)
    after = before[:, :, -1] + chunk_states[:, :, -1]
    return out.reshape(batch, heads, n_chunks * chunk, -1)[:, :, :length], after


# A feature map takes (..., d) to (..., m) token by token. Called as ``feature(x, single_use=True)`` by the chunked
# backward, which differentiates that graph once and drops it, it may let its backward overwrite the features it
# saved instead of allocating a new tensor.
FeatureMap = Callable[..., Tensor]


# Up to this many chunks a prefix sum adds chunk by chunk: on CPU a cumsum over a middle dimension costs several
# times the few adds it replaces.
SCAN_BY_ADDS = 16


def prefix_sums(steps: Tensor, start: Tensor | None, reverse: bool = False) -> Tensor:
    """(B, H, n - 1, ...) ``steps`` -> (B, H, n, ...) running sums from ``start`` ((B, H, ...); None: zeros):
    out[0] = start, out[i + 1] = out[i] + steps[i]; ``reverse``: out[n - 1] = start, out[i] = out[i + 1] + steps[i]."""
    n = steps.shape[2] + 1
    tracked = torch.is_grad_enabled() and (steps.requires_grad or start is not None and start.requires_grad)
    if tracked or n > SCAN_BY_ADDS:
        origin = steps.new_zeros(*steps.shape[:2], 1, *steps.shape[3:]) if start is None else start.unsqueeze(2)
        if reverse:
            return torch.cat([origin + steps.flip(2).cumsum(dim=2).flip(2), origin], dim=2)
        return torch.cat([origin, origin + steps.cumsum(dim=2)], dim=2)
    out = steps.new_empty(*steps.shape[:2], n, *steps.shape[3:])
    first, *rest = range(n - 1, -1, -1) if reverse else range(n)
    if start is None:
        out[:, :, first].zero_()
    else:
        out[:, :, first].copy_(start)
    previous = first
    for i in rest:
        torch.add(out[:, :, previous], steps[:, :, min(i, previous)], out=out[:, :, i])
        previous = i
    return out


def _add_product(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """total + a @ b over the batch dimensions, accumulated by the GEMM itself (no pass over the sum) when
    ``total`` is a contiguous tensor of its own that no autograd graph records."""
    if torch.is_grad_enabled() and (total.requires_grad or a.requires_grad or b.requires_grad) \
            or not total.is_contiguous():
        return total + a @ b
    flat = total.view(-1, *total.shape[-2:])
    a, b = a.to(total.dtype), b.to(total.dtype)  # an in-place GEMM is not autocast: its operands are cast here
    flat.baddbmm_(a.expand(*total.shape[:-2], *a.shape[-2:]).reshape(-1, *a.shape[-2:]),
                  b.expand(*total.shape[:-2], *b.shape[-2:]).reshape(-1, *b.shape[-2:]))
    return total


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, feature_q: FeatureMap, feature_k: FeatureMap, *, causal: bool,
                     chunk: int, eps: float = 1e-6) -> Tensor:
    """phi(q) (phi(k)^T v) row-normalised, for q, k, v (B, H, T, d); ``feature_q`` / ``feature_k`` map (..., d) to
    (..., m) token by token. Causal: :class:`ChunkedCausalKernel`, which never holds the T x m features."""
    if causal:
        return ChunkedCausalKernel.apply(q, k, v, feature_q, feature_k, chunk, eps)
    return kernelized_attention(feature_q(q), feature_k(k), v, causal=False, chunk=chunk, eps=eps)


def kernel_attention_at(positions: Tensor, q: Tensor, k: Tensor, v: Tensor, feature_q: FeatureMap,
                        feature_k: FeatureMap, *, causal: bool, chunk: int, eps: float = 1e-6) -> Tensor:
    """Queries q (B, H, Tq, d) at the global ``positions`` (Tq, ascending) of the sequence of k, v (B, H, T, d) ->
    their rows of :func:`kernel_attention` over the whole sequence (context parallelism: this rank's queries, every
    rank's keys). Causal: each run of consecutive positions [a, b) starts from the state of the keys before a,
    S_a = phi(K_<a)^T [V_<a, 1] (:class:`KeyState`), and runs eq. 8-9 over its own keys; the work is the run's and
    one pass over the earlier keys, not the whole sequence's."""
    if not causal:
        return kernel_attention(q, k, v, feature_q, feature_k, causal=False, chunk=chunk, eps=eps)

    def attend_run(first: int, start: int, size: int) -> Tensor:
        state = KeyState.apply(k.narrow(2, 0, start), v.narrow(2, 0, start), feature_k) if start else None
        return ChunkedCausalKernel.apply(q.narrow(2, first, size), k.narrow(2, start, size),
                                         v.narrow(2, start, size), feature_q, feature_k, chunk, eps, state)

    return over_runs(positions, attend_run)


def over_runs(positions: Tensor, attend_run: Callable[[int, int, int], Tensor]) -> Tensor:
    """``attend_run(first query, first position, size)`` for each run of consecutive ``positions``, concatenated
    along the tokens (dim 2) in query order."""
    outputs, first = [], 0
    for start, stop in consecutive_runs(positions):
        outputs.append(attend_run(first, start, stop - start))
        first += stop - start
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def consecutive_runs(positions: Tensor) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive values in the ascending ``positions``."""
    values = positions.tolist()
    runs, start = [], 0
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[index - 1] + 1:
            runs.append((values[start], values[index - 1] + 1))
            start = index
    return runs


class KeyState(torch.autograd.Function):
    """S = phi(K)^T [V, 1] (B, H, m, d + 1) of keys and values (B, H, T, d), a segment of keys at a time (features
    within 1/``SEGMENT_FRACTION`` of k's elements); the backward recomputes each segment's features: dV = phi(K)
    dS[:, :d], dphi(K) = [V, 1] dS^T, then through the feature map."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, feature_k: FeatureMap) -> Tensor:
        state = _zero_state(k, v, feature_k)
        segment = max(1, k.numel() // SEGMENT_FRACTION // max(1, state.shape[0] * state.shape[1] * state.shape[2]))
        for start in range(0, k.shape[2], segment):
            size = min(segment, k.shape[2] - start)
            state = _state_after(k.narrow(2, start, size), v.narrow(2, start, size), state, feature_k)
        ctx.save_for_backward(k, v)
        ctx.feature_k, ctx.segment = feature_k, segment
        return state

    @staticmethod
    def backward(ctx, grad_state: Tensor) -> tuple[Tensor, Tensor, None]:
        k, v = ctx.saved_tensors
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        for start in range(0, k.shape[2], ctx.segment):
            size = min(ctx.segment, k.shape[2] - start)
            part = k.narrow(2, start, size).detach().requires_grad_()
            with torch.enable_grad():  # a graph differentiated once, below, and dropped
                phi = ctx.feature_k(part, single_use=True)
            values = F.pad(v.narrow(2, start, size), (0, 1), value=1.0)
            grad_v.narrow(2, start, size).copy_((phi.detach() @ grad_state)[..., :-1])
            torch.autograd.backward(phi, values @ grad_state.transpose(-1, -2))
            grad_k.narrow(2, start, size).copy_(part.grad)
        return grad_k, grad_v, None


def _segment_forward(q: Tensor, k: Tensor, v: Tensor, state: Tensor, feature_q: FeatureMap,
                     feature_k: FeatureMap, chunk: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """One segment of whole chunks (eq. 8-9): (output (B, H, S, d), the state after it, the normaliser
    phi(q_i) . sum_{j <= i} phi(k_j) (B, H, S, 1)) from the state S = sum phi(k) [v, 1]^T of the positions before
    it (B, H, m, d + 1)."""
    values = F.pad(v, (0, 1), value=1.0)
    out, after = causal_chunks(feature_q(q), feature_k(k), values, chunk, state)
    return out[..., :-1] / out[..., -1:].clamp_min(eps), after, out[..., -1:]


def _state_after(k: Tensor, v: Tensor, state: Tensor, feature_k: FeatureMap) -> Tensor:
    """The state after a segment's keys and values: S + phi(K)^T [V, 1]."""
    return state + feature_k(k).transpose(-1, -2) @ F.pad(v, (0, 1), value=1.0)


# A segment's features and scores (B x H x tokens x (m + C) elements) stay within 1/SEGMENT_FRACTION of q's elements:
# its chunks run at once and a few such tensors are alive in its backward, so the work memory is a fixed fraction
# of the inputs' at every length (at or below SDPA's peak from 16K tokens: ``xscale bench attention``).
SEGMENT_FRACTION = 8


class ChunkedCausalKernel(torch.autograd.Function):
    """Causal kernel attention over segments of chunks of C tokens, from the state ``initial`` of earlier keys
    (B, H, m, d + 1; None: none), differentiable in it too (every chunk of a segment at once,
    :func:`causal_chunks`; a segment's features and scores within 1/``SEGMENT_FRACTION`` of q) that saves q, k, v,
    the output and its normaliser (T values: the backward needs neither product again) and the running state every
    ~sqrt(segments) segments; the backward walks the segments in reverse, recomputes the
    states inside each checkpointed span, then each segment's features with autograd over that segment alone,
    carrying dL/dS backwards. Memory beyond q, k, v, their gradients and the output: O(sqrt(T)) states of
    m x (d + 1) and one segment's work."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, feature_q: FeatureMap, feature_k: FeatureMap, chunk: int,
                eps: float, initial: Tensor | None = None) -> Tensor:
        length = q.shape[2]
        state = _zero_state(k, v, feature_k) if initial is None else initial.detach()
        per_chunk = state.shape[0] * state.shape[1] * chunk * (state.shape[2] + chunk)  # its features and scores
        segment = chunk * max(1, min(-(-length // chunk), q.numel() // SEGMENT_FRACTION // per_chunk))
        starts = list(range(0, length, segment))
        span = max(1, math.isqrt(len(starts)))  # segments per saved state
        out, normaliser = v.new_empty(v.shape), v.new_empty(*v.shape[:-1], 1)
        checkpoints = []
        for index, start in enumerate(starts):
            parts = [x.narrow(2, start, min(segment, length - start)) for x in (q, k, v)]
            if index % span == 0:
                checkpoints.append(state)
            result, state, sums = _segment_forward(*parts, state, feature_q, feature_k, chunk, eps)
            out.narrow(2, start, result.shape[2]).copy_(result)
            normaliser.narrow(2, start, result.shape[2]).copy_(sums)
        ctx.save_for_backward(q, k, v, out, normaliser, *checkpoints)
        ctx.features, ctx.chunk, ctx.eps, ctx.segment, ctx.span = (feature_q, feature_k), chunk, eps, segment, span
        ctx.has_initial = initial is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, normaliser, *checkpoints = ctx.saved_tensors
        chunk, eps, segment, span, length = ctx.chunk, ctx.eps, ctx.segment, ctx.span, q.shape[2]
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))  # the segments cover every position
        grad_state = torch.zeros_like(checkpoints[0])
        starts = list(range(0, length, segment))
        for first in reversed(range(0, len(starts), span)):
            spans = [(start, min(segment, length - start)) for start in starts[first:first + span]]
            states = [checkpoints[first // span]]
            with torch.no_grad():
                for start, size in spans[:-1]:
                    states.append(_state_after(k.narrow(2, start, size), v.narrow(2, start, size), states[-1],
                                               ctx.features[1]))
            for (start, size), state in zip(reversed(spans), reversed(states)):
                parts = [x.narrow(2, start, size) for x in (q, k, v, grad_out, out, normaliser)]
                segment_grads = _segment_backward(*parts, state, grad_state, ctx.features, chunk, eps)
                for target, grad in zip(grads, segment_grads[:3]):
                    target.narrow(2, start, size).copy_(grad)
                grad_state = segment_grads[3]
        return *grads, None, None, None, None, grad_state if ctx.has_initial else None


def _segment_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, out: Tensor, normaliser: Tensor,
                      state: Tensor, grad_after: Tensor, features: tuple[FeatureMap, FeatureMap], chunk: int,
                      eps: float) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dL/dS before the segment) of one segment: the feature maps recomputed under autograd, and
    the chunked product differentiated by hand (:func:`_chunks_backward`), which keeps few and only
    (B, H, n, C, C)- or state-sized temporaries."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    with torch.enable_grad():  # graphs differentiated once, below, and dropped
        phi_q, phi_k = features[0](q, single_use=True), features[1](k, single_use=True)
    grad_phi_q, grad_phi_k, grad_values, grad_state = _chunks_backward(
        phi_q.detach(), phi_k.detach(), F.pad(v, (0, 1), value=1.0), state, (grad_out, out, normaliser), grad_after,
        chunk, eps)
    torch.autograd.backward((phi_q, phi_k), (grad_phi_q, grad_phi_k))
    return q.grad, k.grad, grad_values[..., :-1], grad_state


def _chunks_backward(phi_q: Tensor, phi_k: Tensor, values: Tensor, state: Tensor,
                     outputs: tuple[Tensor, Tensor, Tensor], grad_after: Tensor, chunk: int,
                     eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``_segment_forward``'s product given its features. Per chunk c (A_c = tril(Pq_c Pk_c^T),
    S_c = S + sum_{c' < c} Pk_c'^T V_c', O_c = A_c V_c + Pq_c S_c, out = O[:d] / max(O[d], eps)):
    dA_c = tril(dO_c V_c^T), dPq_c = dA_c Pk_c + dO_c S_c^T, dS_c = Pq_c^T dO_c,
    dC_c = sum_{c' > c} dS_c' + dS_after (C_c = Pk_c^T V_c), dPk_c = dA_c^T Pq_c + V_c dC_c^T,
    dV_c = A_c^T dO_c + Pk_c dC_c, dS = sum_c dS_c + dS_after. ``outputs``: (d out, out, O[d]) of the segment;
    dO[:d] = d out / max(O[d], eps) and dO[d] = -rowsum(d out * out) / max(O[d], eps) (0 where O[d] < eps)."""
    grad_out, out, normaliser = outputs
    clamped = normaliser.clamp_min(eps)
    grad_normaliser = (grad_out * out).sum(-1, keepdim=True).neg_().div_(clamped)
    grad_normaliser.masked_fill_(normaliser < eps, 0.0)  # clamp_min passes no gradient below eps
    grad_out = torch.cat([grad_out / clamped, grad_normaliser], dim=-1)  # dO
    batch, heads, length, _ = phi_q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # zero features and zero output gradients: the padded rows add nothing
        phi_q, phi_k, values, grad_out = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, values, grad_out))
    phi_q, phi_k, values, grad_out = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1])
                                      for x in (phi_q, phi_k, values, grad_out))
    scores = (phi_q @ phi_k.transpose(-1, -2)).tril_()
    chunk_states = phi_k[:, :, :-1].transpose(-1, -2) @ values[:, :, :-1]  # the last chunk's is not read
    before = prefix_sums(chunk_states, state)
    grad = grad_out
    grad_scores = (grad @ values.transpose(-1, -2)).tril_()
    grad_phi_q = _add_product(grad_scores @ phi_k, grad, before.transpose(-1, -2))
    grad_before = phi_q.transpose(-1, -2) @ grad
    grad_chunk_states = prefix_sums(grad_before[:, :, 1:], grad_after, reverse=True)  # dS_after + sum_{c' > c} dS_c'
    grad_phi_k = _add_product(grad_scores.transpose(-1, -2) @ phi_q, values, grad_chunk_states.transpose(-1, -2))
    grad_values = _add_product(scores.transpose(-1, -2) @ grad, phi_k, grad_chunk_states)
    unchunk = lambda x: x.reshape(batch, heads, n_chunks * chunk, x.shape[-1])[:, :, :length]  # noqa: E731
    grad_state = grad_chunk_states[:, :, 0] + grad_before[:, :, 0]  # dS = sum_c dS_c + dS_after
    return unchunk(grad_phi_q), unchunk(grad_phi_k), unchunk(grad_values), grad_state


def _zero_state(k: Tensor, v: Tensor, feature_k: FeatureMap) -> Tensor:
    """S = 0 (B, H, m, d + 1): m read from the feature map of one key."""
    with torch.no_grad():
        features = feature_k(k.narrow(2, 0, 1)).shape[-1]
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
    parallel_traits = ParallelTraits(tp="split_heads", cp_positions=True)
    attends_to_memory = True

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # a kernel feature map forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        chunk = self.options.chunk
        if (positions := held_query_positions(q, k, context)) is not None:  # context parallelism
            return kernel_attention_at(positions, q, k, v, elu_feature, elu_feature, causal=causal, chunk=chunk)
        if not causal:
            return kernel_attention(q, k, v, elu_feature, elu_feature, causal=False, chunk=chunk)
        return causal_over_longer_keys(
            lambda q, k, v: kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=chunk), q, k, v)


def elu_feature(x: Tensor, single_use: bool = False) -> Tensor:
    """phi(x) = elu(x) + 1 (eq. 7); ``single_use``: see ``FeatureMap``."""
    return EluPlusOne.apply(x, single_use)


class EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 = exp(min(x, 0)) + max(x, 0), whose derivative is min(phi(x), 1): one saved tensor, and on CPU
    ~2.4x faster than ``F.elu(x) + 1`` (torch's elu kernel is slower than its exp)."""

    @staticmethod
    def forward(ctx, x: Tensor, single_use: bool) -> Tensor:
        phi = torch.exp(x.clamp(max=0)).add_(torch.relu(x))
        ctx.save_for_backward(phi)
        ctx.overwrite = single_use
        return phi

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (phi,) = ctx.saved_tensors
        if ctx.overwrite:
            return phi.clamp_(max=1).mul_(grad), None
        return grad * phi.clamp(max=1), None
