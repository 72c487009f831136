"""Chunked causal kernel attention (custom backward over segments of chunks) against the quadratic form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import make_core, random_qkv
from xscale.models.attention import linear
from xscale.models.attention.linear import elu_feature, kernel_attention, kernelized_reference


def elu_written_out(x: torch.Tensor) -> torch.Tensor:
    """phi = elu + 1 through torch's own elu (the reference for the fused feature map)."""
    return F.elu(x) + 1


def performer_written_out(x: torch.Tensor, projection: torch.Tensor, is_query: bool) -> torch.Tensor:
    """FAVOR+ features in plain autograd: exp(w . x' - |x'|^2 / 2), x' = x d^-1/4 (a query's row max shifted
    out and its |x'|^2 left out: both cancel in the query's ratio)."""
    x = x * x.shape[-1] ** -0.25
    logits = x @ projection.to(x.dtype).T
    if is_query:
        return torch.exp(logits - logits.amax(-1, keepdim=True).detach())
    return torch.exp(logits - (x * x).sum(-1, keepdim=True) / 2)


def _grads(out: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> tuple:
    return (out, *torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("chunk", [4, 8, 45, 64], ids=["12-chunks", "6-uneven", "one-chunk", "wider"])
def test_chunked_causal_equals_quadratic(chunk: int) -> None:
    """Output and q/k/v gradients of elu + 1 features, 45 tokens (the last chunk shorter than the others)."""
    q, k, v = random_qkv(2, 3, 45, 8)
    out = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=chunk)
    reference = kernelized_reference(elu_written_out(q), elu_written_out(k), v, causal=True)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_performer_features_match_the_formula_written_out(causal: bool) -> None:
    """Performer's fused feature map (base 2, its own backward) against exp(w.x - |x|^2/2) in plain autograd."""
    core = make_core("performer", causal, {"features": 16, "chunk": 8})
    q, k, v = random_qkv(1, 4, 37, 16, scale=0.5)
    out = core(q, k, v, causal=causal)
    phi_q, phi_k = (performer_written_out(x, core.projection, x is q) for x in (q, k))
    reference = kernelized_reference(phi_q, phi_k, v, causal=causal)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_random_features_causal_equals_quadratic(kind: str) -> None:
    """The random-feature maps (Performer's detached max shift included) go through the chunked backward."""
    core = make_core(kind, True, {"features": 16, "chunk": 8})
    q, k, v = random_qkv(1, 4, 37, 16, scale=0.5)
    out = core(q, k, v, causal=True)
    phi_q, phi_k = core.features(q, True, True), core.features(k, False, True)
    reference = kernelized_reference(phi_q, phi_k, v, causal=True)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-9, rtol=1e-9)


def test_saves_inputs_and_a_few_states() -> None:
    """Autograd keeps q, k, v, the output, its normaliser (T values) and ~sqrt(T / C) states: no T x m features,
    no per-chunk state."""
    q, k, v = random_qkv(1, 2, 1024, 8)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=16)
    kept = {t.untyped_storage().data_ptr() for t in (q, k, v, out)}
    extra = sum(t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() not in kept)
    state_bytes = 2 * 8 * 9 * 8  # (B, H, m, d + 1) float64
    normaliser_bytes = 2 * 1024 * 8
    assert extra <= 8 * state_bytes + normaliser_bytes  # 64 chunks: a state every 8 chunks


@pytest.mark.parametrize("fraction", [10**9, 2], ids=["segment-per-chunk", "two-chunk-segments"])
def test_segments_and_recomputed_states_equal_quadratic(monkeypatch, fraction: int) -> None:
    """Segments smaller than the sequence: states saved every ~sqrt(segments) and recomputed in between."""
    monkeypatch.setattr(linear, "SEGMENT_FRACTION", fraction)
    q, k, v = random_qkv(1, 2, 75, 8)  # chunks of 8: 10 chunks, the last one short
    out = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=8)
    reference = kernelized_reference(elu_written_out(q), elu_written_out(k), v, causal=True)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("n", [1, 2, 5, 18], ids=["one", "two", "five", "cumsum-path"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("with_start", [False, True], ids=["from-zero", "from-start"])
def test_prefix_sums_add_the_steps_in_order(n: int, reverse: bool, with_start: bool) -> None:
    """n - 1 steps give n running sums: out[i] = start + sum_{j < i} steps[j] (reverse: sum_{j >= i}), chunk by
    chunk or by cumsum, against the sums written out."""
    steps = torch.randn(2, 3, n - 1, 4, 5, dtype=torch.float64)
    start = torch.randn(2, 3, 4, 5, dtype=torch.float64) if with_start else None
    out = linear.prefix_sums(steps, start, reverse=reverse)
    assert out.shape == (2, 3, n, 4, 5)
    for i in range(n):
        summed = range(i, n - 1) if reverse else range(i)
        expected = sum((steps[:, :, j] for j in summed), torch.zeros(2, 3, 4, 5, dtype=torch.float64))
        torch.testing.assert_close(out[:, :, i], expected + (start if with_start else 0), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_feature_maps_keep_their_saved_features_outside_the_chunked_backward(kind: str) -> None:
    """Only the chunked backward's own, single-use feature graphs may be overwritten by their backward: an
    ordinary graph (bidirectional attention, retain_graph) gives the same gradient twice."""
    core = make_core(kind, False, {"chunk": 8} if kind == "linear" else {"features": 16, "chunk": 8})
    q, k, v = random_qkv(1, 2, 20, 16, scale=0.5)
    out = core(q, k, v, causal=False)
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("fraction", [8, 10**9], ids=["one-segment", "segment-per-chunk"])
@pytest.mark.parametrize("positions", [[20, 21, 22, 23, 24, 25, 26, 27], [0, 1, 2, 3, 4, 5, 36, 37, 38, 39, 40, 41],
                                       [9, 10, 11, 12, 30, 31, 32, 33, 34]],
                         ids=["one-run", "balanced-first-and-last", "two-inner-runs"])
def test_queries_at_positions_equal_those_rows_of_the_whole_sequence(monkeypatch, positions, fraction) -> None:
    """Context parallelism's path: a rank's queries at global positions against every key give the rows (and, summed
    over the queries, the q/k/v gradients) of the whole sequence's causal kernel attention, each run of positions
    from the state of the keys before it."""
    monkeypatch.setattr(linear, "SEGMENT_FRACTION", fraction)
    q, k, v = random_qkv(2, 3, 42, 8)
    index = torch.tensor(positions)
    grad = torch.randn(2, 3, len(positions), 8, dtype=q.dtype)
    whole = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=4).index_select(2, index)
    local_q = q.detach().index_select(2, index).requires_grad_()
    mine = linear.kernel_attention_at(index, local_q, k, v, elu_feature, elu_feature, causal=True, chunk=4)
    expected = _grads(whole, (q, k, v), grad)
    got = _grads(mine, (local_q, k, v), grad)
    torch.testing.assert_close(got[0], expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[1], expected[1].index_select(2, index), atol=1e-10, rtol=1e-10)
    for name, mine_grad, ref in zip(("k", "v"), got[2:], expected[2:]):
        torch.testing.assert_close(mine_grad, ref, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_consecutive_runs() -> None:
    assert linear.consecutive_runs(torch.tensor([0, 1, 2, 7, 8, 10])) == [(0, 3), (7, 9), (10, 11)]
    assert linear.consecutive_runs(torch.tensor([4])) == [(4, 5)]
