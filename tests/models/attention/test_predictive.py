"""Predictive attention (Wang et al. 2021): two layers against a reference that convolves by summing shifted maps
(heads mixed by each kernel tap) and attends query by query, with gradients for the convolution; causal layers never
read the future; a tensor-parallel rank's output heads from every head's q and k; training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.runtime import StepContext

LENGTH, KERNEL, ALPHA = 7, 3, 0.3


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


def reference_layer(core, q, k, v, previous, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    previous = torch.zeros_like(scores) if previous is None else previous  # S_0 = 0
    scores = ALPHA * convolved(core, previous, causal) + (1 - ALPHA) * scores
    out = torch.zeros_like(q)
    for i in range(LENGTH):
        last = i + 1 if causal else LENGTH
        probs = torch.softmax(scores[:, :, i, :last], -1)
        out[:, :, i] = (probs[:, :, None] @ v[:, :, :last])[:, :, 0]
    return out, scores


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_two_layers_match_the_reference(causal: bool) -> None:
    first = make_core("predictive", causal, {"kernel_size": KERNEL, "alpha": ALPHA}, d_model=32)
    second = make_core("predictive", causal, {"kernel_size": KERNEL, "alpha": ALPHA}, d_model=32)
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out, scores = first(q, k, v, causal=causal)
    out, scores = second(out, k, v, causal=causal, previous_scores=scores)
    ref, ref_scores = reference_layer(first, q, k, v, None, causal)
    ref, ref_scores = reference_layer(second, ref, k, v, ref_scores, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(scores, ref_scores, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, v, *first.parameters(), *second.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_causal_layers_never_read_the_future() -> None:
    first = make_core("predictive", True, {"kernel_size": KERNEL}, d_model=32)
    second = make_core("predictive", True, {"kernel_size": KERNEL}, d_model=32)

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
    first = make_core("predictive", False, d_model=32)
    second = make_core("predictive", False, d_model=32)
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
