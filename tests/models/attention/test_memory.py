"""Low-rank and memory cores (memory_compressed, inducing, luna, synthesizer) against hand-written references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.attention.conftest import dense_reference, make_core, random_qkv
from xscale.config.schema import ConfigError

LENGTH = 45


def _randomise(core: torch.nn.Module, std: float = 0.3) -> None:
    """Give every parameter a non-trivial value (the model's init would make most of them ~0.02)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in core.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, inputs: tuple, atol: float = 1e-10) -> None:
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    grad = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, inputs, grad, retain_graph=True),
                    torch.autograd.grad(ref, inputs, grad, retain_graph=True)):
        torch.testing.assert_close(g, r, atol=atol, rtol=atol)


def _conv_reference(x: torch.Tensor, linear: torch.nn.Linear, c: int) -> torch.Tensor:
    """The strided convolution of the paper, through conv1d (kernel = stride = c) on zero-padded input."""
    batch, heads, length, dim = x.shape
    padded = F.pad(x, (0, 0, 0, -length % c)).reshape(batch * heads, -1, dim).transpose(1, 2)
    weight = linear.weight.view(dim, c, dim).permute(0, 2, 1)  # (out, in, kernel)
    out = F.conv1d(padded, weight, linear.bias, stride=c)
    return out.transpose(1, 2).reshape(batch, heads, -1, dim)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_compressed_equals_its_masked_reference(causal: bool) -> None:
    c = 4
    core = make_core("memory_compressed", causal, {"compression": c})
    _randomise(core)
    q, k, v = random_qkv(2, 4, LENGTH, 16, kv_heads=2)
    out = core(q, k, v, causal=causal)
    keys = _conv_reference(k, core.key_compression, c).repeat_interleave(2, 1)
    values = _conv_reference(v, core.value_compression, c).repeat_interleave(2, 1)
    if not causal:
        ref = F.scaled_dot_product_attention(q, keys, values)
    else:
        n_slots, i = keys.shape[2], torch.arange(LENGTH)[:, None]
        j = torch.arange(LENGTH)[None, :]
        mask = torch.cat([torch.arange(n_slots)[None, :] < i // c, (j <= i) & (j // c == i // c)], dim=1)
        ref = F.scaled_dot_product_attention(q, torch.cat([keys, k.repeat_interleave(2, 1)], 2),
                                             torch.cat([values, v.repeat_interleave(2, 1)], 2), attn_mask=mask)
    _assert_matches(out, ref, (q, k, v))


def test_inducing_points_pool_then_read() -> None:
    core = make_core("inducing", False, {"inducing_points": 5})
    _randomise(core, 1.0)
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    points = core.points
    pool = torch.softmax(torch.einsum("hmd,bhtd->bhmt", points, k) / 4, dim=-1)
    pooled_k, pooled_v = torch.einsum("bhmt,bhtd->bhmd", pool, k), torch.einsum("bhmt,bhtd->bhmd", pool, v)
    weights = torch.softmax(torch.einsum("bhtd,bhmd->bhtm", q, pooled_k) / 4, dim=-1)
    ref = torch.einsum("bhtm,bhmd->bhtd", weights, pooled_v)
    _assert_matches(core(q, k, v, causal=False), ref, (q, k, v, points))
    with pytest.raises(ConfigError, match="causal"):
        make_core("inducing", True)


def luna_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Position t packs positions <= t with a softmax over them, then unpacks: the T x T x l quadratic form."""
    length, scale = q.shape[2], q.shape[-1] ** -0.5
    logits = torch.einsum("hpd,bhjd->bhpj", points, k) * scale
    future = ~torch.ones(length, length, dtype=torch.bool).tril()  # [t, j]
    pack = logits[:, :, :, None, :].masked_fill(future, float("-inf")).softmax(-1)  # (B, H, l, t, j)
    packed_k = torch.einsum("bhptj,bhjd->bhtpd", pack, k)
    packed_v = torch.einsum("bhptj,bhjd->bhtpd", pack, v)
    weights = (torch.einsum("bhtd,bhtpd->bhtp", q, packed_k) * scale).softmax(-1)
    return torch.einsum("bhtp,bhtpd->bhtd", weights, packed_v)


@pytest.mark.parametrize("chunk", [8, 64])
def test_luna_causal_prefix_packing_equals_the_quadratic_form(chunk: int) -> None:
    core = make_core("luna", True, {"packed_length": 5, "chunk": chunk})
    _randomise(core, 1.0)
    q, k, v = random_qkv(2, 4, LENGTH, 16, scale=3.0)  # large logits: the running maximum matters
    _assert_matches(core(q, k, v, causal=True), luna_causal_reference(q, k, v, core.points), (q, k, v, core.points),
                    atol=1e-9)


def test_luna_causal_gradients_stay_finite_when_later_logits_are_huge() -> None:
    """A later key far above the running maximum must not overflow into the earlier positions' gradients."""
    core = make_core("luna", True, {"packed_length": 4, "chunk": 16})
    _randomise(core, 1.0)
    q, k, v = random_qkv(1, 4, LENGTH, 16)
    with torch.no_grad():
        k[:, :, 5] *= 500.0  # inside the first chunk, after positions 0-4
    core(q, k, v, causal=True).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, core.points))


def test_luna_bidirectional_is_the_pooled_form_and_the_last_causal_position_agrees() -> None:
    core = make_core("luna", False, {"packed_length": 5})
    _randomise(core, 1.0)
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    bidirectional = core(q, k, v, causal=False)
    causal = make_core("luna", True, {"packed_length": 5, "chunk": 8})
    causal.load_state_dict(core.state_dict())
    # The last position packs the whole sequence, as every position does without the mask.
    torch.testing.assert_close(causal(q, k, v, causal=True)[:, :, -1], bidirectional[:, :, -1], atol=1e-10, rtol=1e-10)


def test_synthesizer_dense_by_hand() -> None:
    core = make_core("synthesizer", True, {"mode": "dense"})
    _randomise(core)
    q, _, v = random_qkv(2, 4, LENGTH, 16)
    assert core.uses_queries and not core.uses_keys
    hidden = torch.relu(torch.einsum("bhtd,hde->bhte", q, core.hidden_weight) + core.hidden_bias[:, None])
    logits = torch.einsum("bhte,hen->bhtn", hidden, core.output_weight) + core.output_bias[:, None]
    logits = logits[..., :LENGTH].masked_fill(~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(logits, dim=-1) @ v
    placeholder = q.new_empty(2, 4, LENGTH, 0)
    _assert_matches(core(q, placeholder, v, causal=True), ref, (q, v, core.hidden_weight, core.output_weight))


@pytest.mark.parametrize("mode", ["random", "factorized"])
def test_synthesizer_random_modes_by_hand(mode: str) -> None:
    core = make_core("synthesizer", False, {"mode": mode, "rank": 3})
    _randomise(core)
    assert not core.uses_queries and not core.uses_keys
    _, _, v = random_qkv(2, 4, LENGTH, 16)
    if mode == "random":
        logits = core.random_logits[:, :LENGTH, :LENGTH]
    else:
        logits = torch.einsum("hir,hjr->hij", core.random_left[:, :LENGTH], core.random_right[:, :LENGTH])
    ref = torch.softmax(logits, dim=-1) @ v
    placeholder = v.new_empty(2, 4, LENGTH, 0)
    _assert_matches(core(placeholder, placeholder, v, causal=False), ref, (v,))


def test_synthesizer_refusals() -> None:
    with pytest.raises(ConfigError, match="mode"):
        make_core("synthesizer", True, {"mode": "mixture"})
    core = make_core("synthesizer", True, {"mode": "random"})
    with pytest.raises(ValueError, match="max_seq_len"):
        placeholder = torch.empty(1, 4, 65, 0, dtype=torch.float64)
        core(placeholder, placeholder, torch.randn(1, 4, 65, 16, dtype=torch.float64), causal=True)


@pytest.mark.parametrize("kind,options", [
    ("memory_compressed", {"compression": 4}),
    ("luna", {"packed_length": 4, "chunk": 8}),
    ("synthesizer", {"mode": "dense"}),
])
def test_causal_never_sees_the_future(kind: str, options: dict) -> None:
    core = make_core(kind, True, options)
    _randomise(core)
    q, k, v = random_qkv(1, 4, LENGTH, 16)
    out = core(q, k, v, causal=True)
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    q2[:, :, 30:] = torch.randn_like(q2[:, :, 30:]) * 3
    k2[:, :, 30:] = torch.randn_like(k2[:, :, 30:]) * 3
    v2[:, :, 30:] += 1.0
    out2 = core(q2, k2, v2, causal=True)
    torch.testing.assert_close(out[:, :, :30], out2[:, :, :30], atol=1e-12, rtol=0)
    assert not torch.allclose(out[:, :, 30:], out2[:, :, 30:])


def test_memory_compressed_with_compression_one_is_dense() -> None:
    """c = 1 with an identity convolution leaves the keys and values as they are."""
    core = make_core("memory_compressed", False, {"compression": 1})
    with torch.no_grad():
        for linear in (core.key_compression, core.value_compression):
            linear.weight.copy_(torch.eye(16))
            linear.bias.zero_()
    q, k, v = random_qkv(2, 4, LENGTH, 16)
    torch.testing.assert_close(core(q, k, v, causal=False), dense_reference(q, k, v), atol=1e-10, rtol=1e-10)
