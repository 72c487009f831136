"""Approximate cores: exact pieces equal their references, errors against dense attention are bounded,
exact limits are reached, and causal forms never read the future."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import dense_reference, make_core, random_qkv, relative_error
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.attention.linear import kernelized_reference
from xscale.models.attention.lsh import SELF_LOGIT

LENGTH = 45  # not a multiple of any chunk used here


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["linear", "performer", "rfa"])
def test_chunked_prefix_sums_equal_the_quadratic_form(kind: str, causal: bool) -> None:
    core = make_core(kind, causal, {"chunk": 8})
    q, k, v = random_qkv(2, 4, LENGTH, 16, scale=0.5)
    out = core(q, k, v, causal=causal)
    if kind == "linear":
        phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    else:
        phi_q, phi_k = core.features(q, True, causal), core.features(k, False, causal)
    ref = kernelized_reference(phi_q, phi_k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    grad = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, r, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_error_vanishes_for_small_logits(causal: bool) -> None:
    """elu+1 is a first-order match of exp near 0: the error against softmax shrinks with the logit scale."""
    errors = []
    for scale in (0.3, 0.1):
        q, k, v = random_qkv(2, 4, LENGTH, 16, scale=scale)
        errors.append(relative_error(make_core("linear", causal)(q, k, v, causal=causal),
                                     dense_reference(q, k, v, causal=causal)))
    assert errors[1] < errors[0] / 2
    assert errors[0] < 0.15  # measured 0.10 (bidirectional), 0.07 (causal)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_converges_with_more_features(causal: bool) -> None:
    q, k, v = random_qkv(2, 4, LENGTH, 16, scale=0.3)
    ref = dense_reference(q, k, v, causal=causal)
    few = relative_error(make_core("performer", causal, {"features": 16})(q, k, v, causal=causal), ref)
    many = relative_error(make_core("performer", causal, {"features": 4096})(q, k, v, causal=causal), ref)
    assert many < few / 3
    assert many < 0.05  # measured 0.025 (bidirectional), 0.018 (causal)


def test_rfa_converges_to_softmax_of_unit_vectors() -> None:
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    sigma = 1.0
    ref = dense_reference(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=1 / sigma**2)
    errors = [relative_error(make_core("rfa", False, {"features": m, "sigma": sigma})(q, k, v, causal=False), ref)
              for m in (16, 4096)]
    assert errors[1] < errors[0] / 3 and errors[1] < 0.1


def test_performer_features_are_seeded_and_redrawn() -> None:
    a, b = make_core("performer", True, {"seed": 3}), make_core("performer", True, {"seed": 3})
    assert torch.equal(a.projection, b.projection)
    redrawing = make_core("performer", True, {"redraw_every": 2}).train()
    q, k, v = random_qkv(1, 4, 8, 16)
    first = redrawing.projection.clone()
    for _ in range(3):  # forwards alone never redraw: the schedule counts training steps
        redrawing(q, k, v, causal=True)
    assert torch.equal(first, redrawing.projection)
    redrawing.begin_training_step(forwards=4)
    redrawing.begin_training_step(forwards=4)
    assert torch.equal(first, redrawing.projection)
    redrawing.begin_training_step(forwards=4)  # step 2
    second = redrawing.projection.clone()
    assert not torch.equal(first, second)
    redrawing.begin_training_step(forwards=4)
    assert torch.equal(second, redrawing.projection)


def test_linformer_with_identity_projections_is_exact() -> None:
    core = make_core("linformer", False, {"projected_length": LENGTH}, max_seq_len=LENGTH)
    with torch.no_grad():
        core.key_projection.copy_(torch.eye(LENGTH))
        core.value_projection.copy_(torch.eye(LENGTH))
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    torch.testing.assert_close(core(q, k, v, causal=False), dense_reference(q, k, v), atol=1e-10, rtol=1e-10)


def test_linformer_error_is_measured_and_refusals_are_clear() -> None:
    core = make_core("linformer", False, {"projected_length": 16})
    q, k, v = random_qkv(2, 4, LENGTH, 16, scale=0.3)
    error = relative_error(core(q, k, v, causal=False), dense_reference(q, k, v))
    assert 0.0 < error < 5.0  # random (untrained) projections: measured 3.1; training is what makes E, F useful
    with pytest.raises(ValueError, match="max_seq_len"):
        core(*random_qkv(1, 4, 65, 16), causal=False)
    with pytest.raises(ConfigError, match="causal"):
        make_core("linformer", True)


def test_nystrom_with_every_token_a_landmark_is_exact() -> None:
    q, k, v = random_qkv(1, 2, 12, 16, scale=2.0)
    core = make_core("nystrom", False, {"landmarks": 12, "pinv_iterations": 40}, n_heads=2, d_model=32)
    torch.testing.assert_close(core(q, k, v, causal=False), dense_reference(q, k, v), atol=1e-6, rtol=1e-6)


def test_nystrom_error_is_bounded() -> None:
    q, k, v = random_qkv(2, 4, LENGTH, 16, scale=0.3)
    error = relative_error(make_core("nystrom", False, {"landmarks": 8})(q, k, v, causal=False),
                           dense_reference(q, k, v))
    assert error < 0.15  # measured 0.084
    with pytest.raises(ConfigError, match="causal"):
        make_core("nystrom", True)


def lsh_reference(q: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Dense shared-QK attention: unit-norm keys, self only when nothing else is allowed."""
    scores = q @ F.normalize(q, dim=-1).transpose(-1, -2) * q.shape[-1] ** -0.5
    eye = torch.eye(q.shape[2], dtype=torch.bool)
    scores = scores.masked_fill(eye, SELF_LOGIT)
    if causal:
        scores = scores.masked_fill(~torch.ones_like(eye).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_with_one_bucket_and_one_chunk_is_exact(causal: bool) -> None:
    core = make_core("lsh", causal, {"buckets": 1, "rounds": 2, "chunk": 64})
    q, _, v = random_qkv(2, 4, LENGTH, 16)
    out, ref = core(q, q, v, causal=causal), lsh_reference(q, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for g, r in zip(torch.autograd.grad(out.sum(), (q, v)), torch.autograd.grad(ref.sum(), (q, v))):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=1e-9)


def clustered_queries(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared q/k drawn around 4 well-separated directions (the regime LSH is built for) and random values."""
    generator = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(4, 16, generator=generator, dtype=torch.float64), dim=-1) * 12
    ids = torch.randint(0, 4, (2, 4, length), generator=generator)
    q = centers[ids] + 0.3 * torch.randn(2, 4, length, 16, generator=generator, dtype=torch.float64)
    return q, torch.randn(2, 4, length, 16, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("causal,bound", [(False, 0.25), (True, 0.5)])  # measured 0.155, 0.395 with 4 rounds
def test_lsh_error_is_bounded_and_more_rounds_help(causal: bool, bound: float) -> None:
    q, v = clustered_queries(64)
    ref = lsh_reference(q, v, causal)
    errors = [relative_error(make_core("lsh", causal, {"buckets": 4, "rounds": r, "chunk": 32})(q, q, v, causal=causal),
                             ref) for r in (1, 4)]
    assert errors[1] < errors[0]
    assert errors[1] < bound


@pytest.mark.parametrize("kind,options", [
    ("linear", {"chunk": 8}), ("performer", {"chunk": 8}), ("rfa", {"chunk": 8}),
    ("lsh", {"buckets": 4, "rounds": 2, "chunk": 8}),
])
def test_causal_never_sees_the_future(kind: str, options: dict) -> None:
    core = make_core(kind, True, options)
    q, k, v = random_qkv(1, 4, LENGTH, 16)
    if core.shares_qk:
        k = q
    out = core(q, k, v, causal=True)
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    q2[:, :, 30:] = torch.randn_like(q2[:, :, 30:]) * 3
    k2 = q2 if core.shares_qk else k2 + torch.where(torch.arange(LENGTH)[:, None] >= 30, 2.0, 0.0)
    v2[:, :, 30:] += 1.0
    out2 = core(q2, k2, v2, causal=True)
    torch.testing.assert_close(out[:, :, :30], out2[:, :, :30], atol=1e-12, rtol=0)
    assert not torch.allclose(out[:, :, 30:], out2[:, :, 30:])


def test_performer_trains_under_bf16_autocast() -> None:
    """FAVOR+'s custom backward gets bf16 features (a bf16 GEMM under autocast) with fp32 inputs; dx must come back
    in the input's dtype (it raised a dtype mismatch before)."""
    model = build_model(ModelConfig(family="encoder", vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                    max_seq_len=48, attention=AttentionConfig(kind="favor", options={"features": 16})))
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
