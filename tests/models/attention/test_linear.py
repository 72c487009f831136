"""Chunked causal kernel attention (custom backward over segments of chunks) against the quadratic form."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import make_core, random_qkv
from xscale.models.attention import linear
from xscale.models.attention.linear import elu_feature, kernel_attention, kernelized_reference


def _grads(out: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> tuple:
    return (out, *torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("chunk", [4, 8, 45, 64], ids=["12-chunks", "6-uneven", "one-chunk", "wider"])
def test_chunked_causal_equals_quadratic(chunk: int) -> None:
    """Output and q/k/v gradients of elu + 1 features, 45 tokens (the last chunk shorter than the others)."""
    q, k, v = random_qkv(2, 3, 45, 8)
    out = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=chunk)
    reference = kernelized_reference(elu_feature(q), elu_feature(k), v, causal=True)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-10, rtol=1e-10)


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
    """Autograd keeps q, k, v and ~sqrt(T / C) states: no T x m features, no per-chunk state."""
    q, k, v = random_qkv(1, 2, 1024, 8)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=16)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    extra = sum(t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() not in inputs)
    state_bytes = 2 * 8 * 9 * 8  # (B, H, m, d + 1) float64
    assert extra <= 8 * state_bytes  # 64 chunks: a state every 8 chunks


@pytest.mark.parametrize("fraction", [10**9, 2], ids=["segment-per-chunk", "two-chunk-segments"])
def test_segments_and_recomputed_states_equal_quadratic(monkeypatch, fraction: int) -> None:
    """Segments smaller than the sequence: states saved every ~sqrt(segments) and recomputed in between."""
    monkeypatch.setattr(linear, "SEGMENT_FRACTION", fraction)
    q, k, v = random_qkv(1, 2, 75, 8)  # chunks of 8: 10 chunks, the last one short
    out = kernel_attention(q, k, v, elu_feature, elu_feature, causal=True, chunk=8)
    reference = kernelized_reference(elu_feature(q), elu_feature(k), v, causal=True)
    grad = torch.randn_like(out)
    for mine, ref in zip(_grads(out, (q, k, v), grad), _grads(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, ref, atol=1e-10, rtol=1e-10)
