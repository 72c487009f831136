"""The cores that take a segment memory as extra keys (``attends_to_memory``): causal, the Tq queries the last Tq of
the M + Tq keys (Transformer-XL's shifted mask), each against a hand-written reference over the same keys."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import dense_reference, make_core
from xscale.models.attention.linear import elu_feature
from xscale.models.registry import ATTENTION

MEMORY, SEGMENT = 5, 8  # M + T = 13: not a multiple of the block size or chunk, the padded queries cross block edges


def memory_qkv(heads: int = 4, head_dim: int = 16, kv_heads: int | None = None, scale: float = 1.0,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, H, T, hd) for the segment; k, v (2, Hkv, M + T, hd) for [memory ; segment]."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, SEGMENT, head_dim, generator=generator, dtype=torch.float64) * scale
    k = torch.randn(2, kv_heads or heads, MEMORY + SEGMENT, head_dim, generator=generator, dtype=torch.float64) * scale
    v = torch.randn(2, kv_heads or heads, MEMORY + SEGMENT, head_dim, generator=generator, dtype=torch.float64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def query_key_offsets() -> torch.Tensor:
    """(i + M) - j for query i of the segment and key j of [memory ; segment]: how far back key j lies."""
    return torch.arange(MEMORY, MEMORY + SEGMENT)[:, None] - torch.arange(MEMORY + SEGMENT)[None, :]


def kernel_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_{j <= i + M} phi(q_i).phi(k_j) v_j / sum_{j <= i + M} phi(q_i).phi(k_j), written out (Katharopoulos et al.
    2020, eq. 9 with the memory a prefix every query sums over)."""
    weights = (phi_q @ phi_k.transpose(-1, -2)) * (query_key_offsets() >= 0)
    return (weights @ v) / weights.sum(-1, keepdim=True)


def assert_same_with_gradients(out: torch.Tensor, reference: torch.Tensor, inputs: tuple, tolerance: float) -> None:
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)
    for mine, expected in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(reference, inputs, grad)):
        torch.testing.assert_close(mine, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kind, options, allowed", [
    ("local", {"window": 3, "block_size": 4}, lambda back: (back >= 0) & (back <= 3)),
    ("dilated", {"window": 2, "dilation": 2, "block_size": 4}, lambda back: (back >= 0) & (back <= 4) & (back % 2 == 0)),
])
def test_band_reaches_back_into_the_memory(kind, options, allowed):
    """Query i sees the keys of its window over [memory ; segment] positions: the first queries' windows reach into
    the memory. Reference: dense softmax attention with that explicit mask (and its gradients)."""
    core = make_core(kind, True, options)
    q, k, v = memory_qkv()
    mask = allowed(query_key_offsets())
    assert mask[0, :MEMORY].any(), "the first query's window must reach into the memory"
    assert_same_with_gradients(core(q, k, v, causal=True), dense_reference(q, k, v, mask=mask), (q, k, v), 1e-10)


def test_linear_attention_sums_over_the_memory_then_causally():
    core = make_core("linear", True, {"chunk": 3})
    q, k, v = memory_qkv(kv_heads=2)  # GQA: each kv head serves two query heads
    expand = lambda x: x.repeat_interleave(2, dim=1)  # noqa: E731
    reference = kernel_reference(elu_feature(q), elu_feature(expand(k)), expand(v))
    assert_same_with_gradients(core(q, k, v, causal=True), reference, (q, k, v), 1e-10)


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_random_features_sum_over_the_memory_then_causally(kind):
    """FAVOR+ (and RFA): the same explicit sum over the core's own random features."""
    core = make_core(kind, True, {"features": 16, "chunk": 4})
    q, k, v = memory_qkv(scale=0.5)
    reference = kernel_reference(core.features(q, True, True), core.features(k, False, True), v)
    assert_same_with_gradients(core(q, k, v, causal=True), reference, (q, k, v), 1e-9)


def test_cores_that_take_the_memory():
    """The set the validator names; any other core is refused with a segment memory."""
    able = {name for name in ATTENTION.names() if ATTENTION.get(name).attends_to_memory}
    assert able == {"dense", "mha", "mqa", "gqa", "local", "band", "sliding_window", "dilated", "linear",
                    "performer", "favor", "rfa"}
