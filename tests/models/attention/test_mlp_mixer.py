"""MLP-Mixer's token mixing (Tolstikhin et al. 2021): eq. 1 token by token and hidden unit by hidden unit, the causal
masked form, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError

LENGTH = 10


def loop_reference(core, v: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    tokens = core.norm(v.repeat_interleave(heads // v.shape[1], 1))
    w1, b1, w2, b2 = core.token_in.weight, core.token_in.bias, core.token_out.weight, core.token_out.bias
    hidden = [F.gelu(sum(w1[j, t] * tokens[:, :, t] for t in range(LENGTH) if t <= j or not causal) + b1[j])
              for j in range(LENGTH)]
    return torch.stack([sum(w2[i, j] * hidden[j] for j in range(LENGTH) if j <= i or not causal) + b2[i]
                        for i in range(LENGTH)], dim=2)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    core = make_core("mlp_mixer", causal, d_model=32, max_seq_len=16)
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(core, v, 4, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (v, *core.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_causal_outputs_do_not_read_later_tokens() -> None:
    core = make_core("mlp_mixer", True, d_model=32, max_seq_len=16)
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    later = v.detach().clone()
    later[:, :, 6:] = torch.randn_like(later[:, :, 6:])
    torch.testing.assert_close(core(q, k, v, causal=True)[:, :, :6], core(q, k, later, causal=True)[:, :, :6])


def test_refuses_sequences_longer_than_max_seq_len() -> None:
    with pytest.raises(ConfigError, match="raise model.max_seq_len"):
        make_core("mlp_mixer", False, max_seq_len=8)(*random_qkv(1, 4, LENGTH, 16), causal=False)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("mlp_mixer", family=family)
