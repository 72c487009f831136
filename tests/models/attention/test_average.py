"""The average attention network (Zhang et al. 2018): eq. 1-3 against a position-by-position loop, never reading the
future, the encoder refusal, training."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.attention.core import build_core

LENGTH = 9


def loop_reference(core, q, v) -> torch.Tensor:
    groups = q.shape[1] // v.shape[1]
    v = v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    for j in range(LENGTH):
        average = v[:, :, : j + 1].sum(2) / (j + 1)
        g = core.ffn_out(torch.relu(core.ffn_in(average)))
        gates = torch.sigmoid(core.gates(torch.cat([q[:, :, j], g], -1)))
        out[:, :, j] = gates[..., :8] * q[:, :, j] + gates[..., 8:] * g
    return out


def test_matches_the_loop_reference() -> None:
    core = make_core("average", True, d_model=32)  # head_dim 8
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=True)
    ref = loop_reference(core, q, v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(out)
    inputs = (q, v, *core.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_never_reads_the_future() -> None:
    core = make_core("average", True, d_model=32)
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    changed_q, changed_v = q.detach().clone(), v.detach().clone()
    changed_q[:, :, 5:] += 3.0
    changed_v[:, :, 5:] -= 3.0
    torch.testing.assert_close(core(changed_q, k, changed_v, causal=True)[:, :, :5],
                               core(q, k, v, causal=True)[:, :, :5])


def test_refused_in_an_encoder() -> None:
    with pytest.raises(ConfigError, match="attention 'average' is decoder-only"):
        build_core("average", ModelConfig(n_heads=4, d_model=64), 0, {}, False, False)


def test_trains() -> None:
    assert_loss_falls("average")
