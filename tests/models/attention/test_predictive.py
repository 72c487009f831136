"""Predictive attention (Wang et al. 2021): three layers in either form against a reference that convolves by summing
shifted maps (heads mixed by each kernel tap) and attends query by query, the first layer plain attention, with
gradients for the convolutions; causal layers never read the future; a tensor-parallel rank's output heads from
every head's q and k; options refused; training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, dense_reference, random_qkv
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models.attention.core import build_core
from xscale.models.attention.predictive import PredictiveOptions
from xscale.runtime import StepContext

LENGTH, KERNEL, ALPHA, RESIDUAL = 7, 3, 0.3, 0.6


def layer(index: int, causal: bool, options: dict | None = None):
    """The predictive core of layer ``index`` of a model of predictive layers (width 32, 4 heads)."""
    config = ModelConfig(n_heads=4, d_model=32, max_seq_len=64, attention=AttentionConfig(kind="predictive"))
    return build_core("predictive", config, index, options or {}, causal, False).double()


def convolved(core, previous: torch.Tensor, causal: bool) -> torch.Tensor:
    """out[g, i, j] = b_g + sum_{h, a, c} W[g, h, a, c] previous[h, i + a - top, j + c - left] (zero outside)."""
    weight, bias = core.convolution.weight, core.convolution.bias
    top = KERNEL - 1 if causal else KERNEL // 2
    out = bias[None, :, None, None].expand_as(previous).clone()
    for a in range(KERNEL):
        for c in range(KERNEL):
            shifted = torch.zeros_like(previous)
            for i in range(LENGTH):
                for j in range(LENGTH):
                    row, column = i + a - top, j + c - top
                    if 0 <= row < LENGTH and 0 <= column < LENGTH:
                        shifted[:, :, i, j] = previous[:, :, row, column]
            out = out + torch.einsum("gh,bhij->bgij", weight[:, :, a, c], shifted)
    return out


def reference_layer(core, q, k, v, previous, causal: bool, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """S = C without a previous map; predictive: alpha conv(S_prev) + (1 - alpha) C; evolving: X = r S_prev +
    (1 - r) C, alpha relu(conv(X)) + (1 - alpha) X. Then softmax over the keys each query may see."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    if previous is not None and form == "predictive":
        scores = ALPHA * convolved(core, previous, causal) + (1 - ALPHA) * scores
    elif previous is not None:
        mix = RESIDUAL * previous + (1 - RESIDUAL) * scores
        scores = ALPHA * torch.relu(convolved(core, mix, causal)) + (1 - ALPHA) * mix
    out = torch.zeros_like(q)
    for i in range(LENGTH):
        last = i + 1 if causal else LENGTH
        probs = torch.softmax(scores[:, :, i, :last], -1)
        out[:, :, i] = (probs[:, :, None] @ v[:, :, :last])[:, :, 0]
    return out, scores


def _options(form: str) -> dict:
    options = {"kernel_size": KERNEL, "alpha": ALPHA, "form": form}
    return options | ({"residual": RESIDUAL} if form == "evolving" else {})


@pytest.mark.parametrize("form", ["predictive", "evolving"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_three_layers_match_the_reference(causal: bool, form: str) -> None:
    layers = [layer(index, causal, _options(form)) for index in range(3)]
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out, scores, ref, ref_scores = q, None, q, None
    for core in layers:
        out, scores = core(out, k, v, causal=causal, previous_scores=scores)
        ref, ref_scores = reference_layer(core, ref, k, v, ref_scores, causal, form)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(scores, ref_scores, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, v, *(parameter for core in layers for parameter in core.parameters()))
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_the_first_layer_is_plain_attention() -> None:
    """No map to read: the first layer's probabilities are softmax(Q K^T / sqrt(d)), not of (1 - alpha) times it."""
    first = layer(0, False, {"alpha": ALPHA})
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    out, scores = first(q, k, v, causal=False)
    torch.testing.assert_close(out, dense_reference(q, k, v), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(scores, q @ k.transpose(-1, -2) / math.sqrt(8), atol=1e-12, rtol=1e-12)
    assert first.convolution is None and layer(1, False).convolution is not None  # nothing to convolve, no weights
    with pytest.raises(ValueError, match="first carrying layer"):
        first(q, k, v, causal=False, previous_scores=scores)


@pytest.mark.parametrize("options,message", [
    ({"form": "ea"}, "form='ea' is not a form of 'predictive'"),
    ({"residual": 0.5}, "residual is read by form=evolving only"),
    ({"form": "evolving", "residual": 1.5}, r"residual must be in \[0, 1\]"),
])
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        PredictiveOptions(**options)


@pytest.mark.parametrize("form", ["predictive", "evolving"])
def test_causal_layers_never_read_the_future(form: str) -> None:
    first, second = layer(0, True, _options(form)), layer(1, True, _options(form))

    def two_layers(q, k, v):
        out, scores = first(q, k, v, causal=True)
        return second(out, k, v, causal=True, previous_scores=scores)[0]

    q, k, v = random_qkv(1, 4, LENGTH, 8)
    changed = [x.detach().clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, 4:] = torch.randn_like(x[:, :, 4:])
    torch.testing.assert_close(two_layers(*changed)[:, :, :4], two_layers(q, k, v)[:, :, :4])


def test_a_tensor_parallel_rank_computes_its_output_heads_from_every_head() -> None:
    """Rank 1 of tp=2 gets all heads' q and k (gathered) and its own v: heads 2 and 3 of the whole output, and
    every head's maps to carry."""
    first, second = layer(0, False), layer(1, False)
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    previous = first(q, k, v, causal=False)[1]
    whole, whole_scores = second(q, k, v, causal=False, previous_scores=previous)
    rank, rank_scores = second(q, k, v[:, 2:], causal=False, previous_scores=previous,
                               context=StepContext(tensor_rank=1, tensor_size=2))
    torch.testing.assert_close(rank, whole[:, 2:], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rank_scores, whole_scores, atol=0, rtol=0)
    with pytest.raises(ValueError, match="must gather every head's q and k"):
        second(q[:, 2:], k[:, 2:], v[:, 2:], causal=False)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("predictive", family=family)


def test_the_evolving_form_trains() -> None:
    assert_loss_falls("predictive", {"form": "evolving"})
