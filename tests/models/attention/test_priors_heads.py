"""Priors and head changes (realformer, gaussian, adaptive_span, talking_heads): hand references, the dense limits
they reach, RealFormer's scores between blocks, and the adaptive-span penalty."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.models.attention.conftest import dense_reference, make_core, random_qkv
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.attention.priors import adaptive_span_metrics

LENGTH = 45


def _check_grads(out: torch.Tensor, ref: torch.Tensor, inputs: tuple, atol: float = 1e-10) -> None:
    grad = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, inputs, grad, retain_graph=True),
                    torch.autograd.grad(ref, inputs, grad, retain_graph=True)):
        torch.testing.assert_close(g, r, atol=atol, rtol=atol)


@pytest.mark.parametrize("causal", [False, True])
def test_realformer_adds_the_previous_scores_layer_after_layer(causal: bool) -> None:
    core = make_core("realformer", causal)
    layers = [random_qkv(2, 4, LENGTH, 16, seed=s) for s in range(3)]
    alibi = -0.1 * (torch.arange(LENGTH)[:, None] - torch.arange(LENGTH)[None, :]).abs().double()
    future = ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() if causal else torch.zeros(LENGTH, LENGTH).bool()
    scores, carried = None, torch.zeros(2, 4, LENGTH, LENGTH, dtype=torch.float64)
    for q, k, v in layers:
        out, scores = core(q, k, v, causal=causal, bias=alibi, previous_scores=scores)
        carried = carried + q @ k.transpose(-1, -2) / 4  # S_l = Q K^T / sqrt(d) + S_{l-1}; ALiBi is not carried
        ref = torch.softmax((carried + alibi).masked_fill(future, float("-inf")), dim=-1) @ v
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(scores, carried, atol=1e-10, rtol=1e-10)
    # The last output reaches every layer's queries and keys through the carried scores.
    _check_grads(out, ref, tuple(x for q, k, _ in layers for x in (q, k)) + (layers[-1][2],))
    first = core(*layers[0], causal=causal)[0]  # S_0 = 0: the first layer is dense attention
    torch.testing.assert_close(first, dense_reference(*layers[0], causal=causal), atol=1e-10, rtol=1e-10)


def _model(kind: str, **overrides) -> torch.nn.Module:
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, max_seq_len=48,
                         attention=AttentionConfig(kind=kind), **overrides)
    return build_model(config, seed=3).double()


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_realformer_scores_travel_between_blocks_and_split_like_a_pipeline(family: str) -> None:
    realformer, dense = _model("realformer", family=family), _model("dense", family=family)
    tokens = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(0))
    whole = realformer(tokens)
    # Two pipeline stages cut from the model: the first sends (x, scores), the second resumes from them.
    first, second = copy.deepcopy(realformer), copy.deepcopy(realformer)
    first.keep_layers([0, 1])
    second.keep_layers([2, 3])
    sent = first(tokens)
    assert isinstance(sent, tuple) and sent[1].shape == (2, 2, 21, 21)
    torch.testing.assert_close(second(*sent), whole, atol=0, rtol=0)
    # Same weights (same parameter names): block 0 equals dense attention, the rest do not.
    x = realformer.embedding(tokens)
    first_real = realformer.stack.blocks()[0](x, realformer.stack.position)[0]
    first_dense = dense.stack.blocks()[0](x, dense.stack.position)
    torch.testing.assert_close(first_real, first_dense, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(realformer(tokens), dense(tokens))


def test_realformer_mixed_with_other_layers_and_encoder_decoder() -> None:
    mixed = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, max_seq_len=48,
                        attention=AttentionConfig(per_layer=["realformer", "dense"]))
    tokens = torch.randint(0, 64, (2, 13))
    assert torch.isfinite(build_model(mixed)(tokens)).all()
    t5_like = _model("realformer", family="encoder_decoder", position="t5_bias", n_decoder_layers=2)
    assert t5_like(tokens, decoder_input_ids=tokens).shape == (2, 13, 64)


@pytest.mark.parametrize("causal", [False, True])
def test_gaussian_prior_by_hand(causal: bool) -> None:
    core = make_core("gaussian", causal, {"sigma": 3.0})
    with torch.no_grad():
        core.log_sigma_offset.copy_(torch.tensor([0.0, 0.5, -0.5, 1.0]))
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    sigma = 3.0 * torch.exp(core.log_sigma_offset)
    distance = (torch.arange(LENGTH)[:, None] - torch.arange(LENGTH)[None, :]).double()
    logits = q @ k.transpose(-1, -2) / 4 - distance**2 / (2 * sigma[:, None, None] ** 2)
    if causal:
        logits = logits.masked_fill(~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(logits, dim=-1) @ v
    out = core(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    _check_grads(out, ref, (q, k, v, core.log_sigma_offset))
    wide = make_core("gaussian", causal, {"sigma": 1e7})  # sigma -> infinity: dense attention
    torch.testing.assert_close(wide(q, k, v, causal=causal), dense_reference(q, k, v, causal=causal),
                               atol=1e-9, rtol=1e-9)


def adaptive_span_reference(q, k, v, span: torch.Tensor, ramp: int, causal: bool) -> torch.Tensor:
    """The paper's form: softmax weights times the soft mask m_z, renormalised."""
    distance = (torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]).double()
    if not causal:
        distance = distance.abs()
    mask = ((ramp + span[:, None, None] - distance) / ramp).clamp(0, 1)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) * mask
    if causal:
        weights = weights.tril()
    return (weights / weights.sum(-1, keepdim=True)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_span_by_hand_and_its_penalty(causal: bool) -> None:
    core = make_core("adaptive_span", causal, {"max_span": 40, "ramp": 8, "span_loss": 0.01})
    with torch.no_grad():
        # Spans 2.4, 8.5, 20.4, -2 tokens: off the integer distances, where the mask's kinks would make the
        # two forms pick different subgradients.
        core.span_fraction.copy_(torch.tensor([0.06, 0.2125, 0.51, -0.05]))
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    out = core(q, k, v, causal=causal)
    ref = adaptive_span_reference(q, k, v, 40 * core.span_fraction, 8, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    (g_out,) = torch.autograd.grad(out, (core.span_fraction,), grad, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, (core.span_fraction,), grad, retain_graph=True)
    # The penalty 0.01 * sum(max(z, 0)) adds d/df = 0.01 * 40 for the three heads with z > 0.
    torch.testing.assert_close(g_out - g_ref, torch.tensor([0.4, 0.4, 0.4, 0.0], dtype=torch.float64))
    torch.testing.assert_close(core.span_penalty(), torch.tensor(0.01 * (2.4 + 8.5 + 20.4), dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_span_covering_the_sequence_is_dense(causal: bool) -> None:
    core = make_core("adaptive_span", causal, {"max_span": 64, "ramp": 8, "span_loss": 0.0})
    with torch.no_grad():
        core.span_fraction.fill_(1.0)
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    torch.testing.assert_close(core(q, k, v, causal=causal), dense_reference(q, k, v, causal=causal),
                               atol=1e-10, rtol=1e-10)


def test_adaptive_span_penalty_reaches_the_model_gradients() -> None:
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                         attention=AttentionConfig(kind="adaptive_span",
                                                   options={"max_span": 32, "ramp": 4, "span_loss": 1.0}))
    model = build_model(config)
    cores = [block.attention.sublayer.core for block in model.stack.blocks()]
    with torch.no_grad():
        for core in cores:
            core.span_fraction.fill_(0.25)
    (model(torch.randint(0, 64, (2, 11))) * 0).sum().backward()  # only the penalty has a gradient
    for core in cores:
        torch.testing.assert_close(core.span_fraction.grad, torch.full((2,), 32.0))
    assert adaptive_span_metrics(model) == {"attention/layer0/span_mean": 8.0, "attention/layer0/span_max": 8.0,
                                            "attention/layer1/span_mean": 8.0, "attention/layer1/span_max": 8.0}


@pytest.mark.parametrize("causal", [False, True])
def test_talking_heads_by_hand(causal: bool) -> None:
    core = make_core("talking_heads", causal)
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    torch.testing.assert_close(core(q, k, v, causal=causal), dense_reference(q, k, v, causal=causal),
                               atol=1e-10, rtol=1e-10)  # identity mixing at initialisation: dense
    with torch.no_grad():
        core.pre_softmax_mix_delta.normal_(0, 0.5)
        core.post_softmax_mix_delta.normal_(0, 0.5)
    pre = torch.eye(4, dtype=torch.float64) + core.pre_softmax_mix_delta
    post = torch.eye(4, dtype=torch.float64) + core.post_softmax_mix_delta
    logits = q @ k.transpose(-1, -2) / math.sqrt(16)
    mixed = torch.stack([sum(logits[:, h] * pre[h, g] for h in range(4)) for g in range(4)], dim=1)
    if causal:
        mixed = mixed.masked_fill(~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), float("-inf"))
    weights = torch.softmax(mixed, dim=-1)
    weights = torch.stack([sum(weights[:, h] * post[h, g] for h in range(4)) for g in range(4)], dim=1)
    ref = weights @ v
    out = core(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    _check_grads(out, ref, (q, k, v, core.pre_softmax_mix_delta, core.post_softmax_mix_delta))
    assert core.mixes_heads


def test_per_head_state_must_match_the_heads() -> None:
    q, k, v = random_qkv(1, 2, 8, 16)  # 2 heads, as a tensor-parallel rank of a 4-head model would see
    for kind in ("gaussian", "adaptive_span", "talking_heads", "routing"):
        with pytest.raises(ValueError, match="per-head state|mixes heads"):
            make_core(kind, True)(q, k, v, causal=True)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="sigma"):
        make_core("gaussian", True, {"sigma": 0.0})
    with pytest.raises(ConfigError, match="ramp"):
        make_core("adaptive_span", True, {"ramp": 0})
    with pytest.raises(ConfigError, match="span_loss"):
        make_core("adaptive_span", True, {"span_loss": -1.0})
