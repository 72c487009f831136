"""gMLP's spatial gating unit (Liu et al. 2021): eq. 2-3 position by position, causal W lower-triangular, the
near-identity start (b = 1), training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError

LENGTH = 10


def loop_reference(core, q, v, causal: bool) -> torch.Tensor:
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    z2 = core.norm(F.gelu(v))
    out = torch.zeros_like(q)
    for i in range(LENGTH):
        mixed = sum(core.spatial.weight[i, j] * z2[:, :, j] for j in range(LENGTH) if j <= i or not causal)
        out[:, :, i] = F.gelu(q[:, :, i]) * (mixed + 1 + core.spatial.bias[i])
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_matches_the_loop_reference(causal: bool) -> None:
    core = make_core("gmlp", causal, d_model=32, max_seq_len=16)
    with torch.no_grad():
        core.spatial.weight.normal_()
        core.spatial.bias.normal_()
    q, k, v = random_qkv(2, 4, LENGTH, 8, kv_heads=2)
    out = core(q, k, v, causal=causal)
    ref = loop_reference(core, q, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    inputs = (q, v, *core.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_starts_as_a_gate_of_each_token_by_itself() -> None:
    """With W = 0 and b = 1 the unit is GeLU(q): no token mixing yet (an FFN-like start)."""
    core = make_core("gmlp", True, d_model=32, max_seq_len=16)
    with torch.no_grad():
        core.spatial.weight.zero_()
        core.spatial.bias.zero_()
    q, k, v = random_qkv(1, 4, LENGTH, 8)
    torch.testing.assert_close(core(q, k, v, causal=True), F.gelu(q))


def test_refuses_sequences_longer_than_max_seq_len() -> None:
    with pytest.raises(ConfigError, match="raise model.max_seq_len"):
        make_core("gmlp", False, max_seq_len=8)(*random_qkv(1, 4, LENGTH, 16), causal=False)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_trains(family: str) -> None:
    assert_loss_falls("gmlp", family=family)
