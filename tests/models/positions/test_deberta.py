"""DeBERTa's disentangled attention (He et al. 2021): the content-to-position and position-to-content terms against a
loop over heads and positions (with gradients, GQA keys), a KV-cache row, training."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls
from xscale.models.positions.deberta import DebertaOptions, DisentangledPosition

HEADS, HEAD_DIM, LENGTH, REACH = 4, 4, 9, 3


def _deberta() -> DisentangledPosition:
    torch.manual_seed(0)
    position = DisentangledPosition(HEADS * HEAD_DIM, HEADS, HEAD_DIM, 16, True,
                                    options=DebertaOptions(max_distance=REACH)).double()
    for parameter in position.parameters():
        torch.nn.init.normal_(parameter)
    return position


def loop_reference(position: DisentangledPosition, q, k) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    key_r = position.key_projection(position.relative_embeddings).view(-1, HEADS, HEAD_DIM)
    query_r = position.query_projection(position.relative_embeddings).view(-1, HEADS, HEAD_DIM)
    offset = k.shape[2] - q.shape[2]
    out = torch.zeros(q.shape[0], HEADS, q.shape[2], k.shape[2], dtype=q.dtype)
    for h in range(HEADS):
        for i in range(q.shape[2]):
            for j in range(k.shape[2]):
                position_i = i + offset
                forward = min(max(position_i - j, -REACH), REACH - 1) + REACH  # delta(i, j)
                backward = min(max(j - position_i, -REACH), REACH - 1) + REACH  # delta(j, i)
                out[:, h, i, j] = (q[:, h, i] @ key_r[forward, h] + k[:, h, j] @ query_r[backward, h]) / math.sqrt(
                    3 * HEAD_DIM)
    return out


@pytest.mark.parametrize("q_len", [LENGTH, 2], ids=["whole", "kv-cache"])
def test_matches_the_loop_reference(q_len: int) -> None:
    position = _deberta()
    q = torch.randn(2, HEADS, q_len, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, LENGTH, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    out = position.content_bias(q, k, slice(0, HEADS))
    ref = loop_reference(position, q, k)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, k, *position.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_a_head_slice_reads_its_heads() -> None:
    position = _deberta()
    q = torch.randn(1, HEADS, LENGTH, HEAD_DIM, dtype=torch.float64)
    k = torch.randn(1, HEADS, LENGTH, HEAD_DIM, dtype=torch.float64)
    whole = position.content_bias(q, k, slice(0, HEADS))
    torch.testing.assert_close(position.content_bias(q[:, 2:], k[:, 2:], slice(2, 4)), whole[:, 2:])


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("dense", family=family, position="deberta")
