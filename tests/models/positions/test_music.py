"""Music Transformer relative attention (Huang et al. 2018): the skewed S_rel against a loop over (head, i, j) (with
gradients, both directions, a KV-cache row), the skew against its index formula, no (T, T, D_h) tensor saved for the
backward, a head slice, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls
from xscale.models.positions.music import MusicOptions, MusicRelativePosition, skew

HEADS, HEAD_DIM, LENGTH = 4, 4, 9


def _music(causal: bool, max_distance: int) -> MusicRelativePosition:
    torch.manual_seed(0)
    position = MusicRelativePosition(HEADS * HEAD_DIM, HEADS, HEAD_DIM, 16, causal,
                                     options=MusicOptions(max_distance=max_distance)).double()
    torch.nn.init.normal_(position.embeddings)
    return position


def loop_reference(position: MusicRelativePosition, q: torch.Tensor, k_len: int, causal: bool,
                   max_distance: int) -> torch.Tensor:
    """q_i E_{clip(j - i)} / sqrt(D_h), E's row of distance r at r + k (rows -k..0 when causal, -k..k otherwise)."""
    reach = max_distance or 15
    offset = k_len - q.shape[2]
    out = torch.zeros(q.shape[0], HEADS, q.shape[2], k_len, dtype=q.dtype)
    for h in range(HEADS):
        for i in range(q.shape[2]):
            for j in range(k_len):
                distance = min(max(j - (i + offset), -reach), 0 if causal else reach)
                out[:, h, i, j] = q[:, h, i] @ position.embeddings[h, distance + reach] / math.sqrt(HEAD_DIM)
    return out


@pytest.mark.parametrize("causal,max_distance,q_len", [(True, 0, LENGTH), (False, 3, LENGTH), (True, 3, 2),
                                                       (False, 0, 3)],
                         ids=["causal-all", "bidirectional-clipped", "causal-kv-cache", "bidirectional-kv-cache"])
def test_matches_the_loop_reference(causal: bool, max_distance: int, q_len: int) -> None:
    position = _music(causal, max_distance)
    q = torch.randn(2, HEADS, q_len, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, LENGTH, HEAD_DIM, dtype=torch.float64)
    out = position.content_bias(q, k, slice(0, HEADS))
    ref = loop_reference(position, q, LENGTH, causal, max_distance)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, position.embeddings)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("q_len,k_len", [(5, 5), (2, 7), (1, 4)])
def test_skew_moves_each_distance_to_its_key(q_len: int, k_len: int) -> None:
    by_distance = torch.randn(3, q_len, q_len + k_len - 1)
    expected = torch.stack([torch.stack([by_distance[:, i, j - i + q_len - 1] for j in range(k_len)], -1)
                            for i in range(q_len)], -2)
    torch.testing.assert_close(skew(by_distance, k_len), expected, atol=0, rtol=0)


def test_saves_no_per_pair_embeddings_for_the_backward() -> None:
    """The memory claim: nothing saved is as large as Shaw's (B, h, T, T, D_h) per-pair embeddings; the largest is
    the skew's (B, h, T, 2T - 1) scores (the logits' size)."""
    length = 32
    position = MusicRelativePosition(HEADS * HEAD_DIM, HEADS, HEAD_DIM, length, False)
    torch.nn.init.normal_(position.embeddings)
    q = torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True)
    saved = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        position.content_bias(q, q, slice(None)).sum().backward()
    assert saved and max(saved) <= 2 * HEADS * length * (2 * length - 1) < 2 * HEADS * length * length * HEAD_DIM


def test_a_head_slice_reads_its_heads() -> None:
    position = _music(False, 3)
    q = torch.randn(1, HEADS, LENGTH, HEAD_DIM, dtype=torch.float64)
    whole = position.content_bias(q, q, slice(0, HEADS))
    torch.testing.assert_close(position.content_bias(q[:, 2:], q[:, 2:], slice(2, 4)), whole[:, 2:])


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("dense", family=family, position="music")
