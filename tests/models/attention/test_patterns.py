"""Every position pattern through the block-sparse kernel equals dense SDPA with the pattern's mask."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.attention.conftest import dense_reference, make_core, random_qkv
from xscale.config.schema import ConfigError
from xscale.models.attention import patterns as P
from xscale.models.attention.block_sparse import build_plan

CASES = [
    ("local", {"window": 5, "block_size": 8}),
    ("local", {"window": 20, "block_size": 8}),
    ("block_local", {"chunk": 6, "neighbours": 1, "block_size": 8}),
    ("dilated", {"window": 3, "dilation": 3, "block_size": 8}),
    ("strided", {"stride": 5, "block_size": 8}),
    ("strided", {"stride": 6, "split_heads": True, "block_size": 8}),
    ("fixed", {"stride": 7, "summary": 2, "block_size": 8}),
    ("fixed", {"stride": 7, "summary": 2, "split_heads": True, "block_size": 8}),
    ("global", {"global_tokens": 3, "block_size": 8}),
    ("random", {"random_blocks": 2, "window": 1, "block_size": 8}),
    ("longformer", {"window": 6, "global_tokens": 3, "block_size": 8}),
    ("bigbird", {"window": 6, "global_tokens": 3, "random_blocks": 2, "block_size": 8}),
    ("star", {"block_size": 8}),
    ("axial", {"row": 6, "block_size": 8}),
]


def _cases():
    for kind, options in CASES:
        for causal in (False, True):
            if kind == "star" and causal:
                continue
            yield pytest.param(kind, options, causal, id=f"{kind}-{'causal' if causal else 'bidir'}-{len(options)}")


@pytest.mark.parametrize("kind,options,causal", list(_cases()))
def test_block_sparse_equals_dense_masked(kind: str, options: dict, causal: bool) -> None:
    length = 45  # not a multiple of the block (8)
    core = make_core(kind, causal, options)
    q, k, v = random_qkv(2, 4, length, 16)
    out = core(q, k, v, causal=causal)
    mask = P.reference_mask(core.pattern, length, options["block_size"], causal, n_heads=4)
    ref = dense_reference(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


def test_float32_and_gqa() -> None:
    core = make_core("bigbird", True, {"window": 6, "global_tokens": 2, "block_size": 8}, n_kv_heads=2).float()
    q, k, v = (t.detach().float().requires_grad_() for t in random_qkv(1, 4, 37, 16, kv_heads=2))
    out = core(q, k, v, causal=True)
    ref = dense_reference(q, k, v, P.reference_mask(core.pattern, 37, 8, True, 4), causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,options", CASES)
def test_layout_covers_the_token_rule(kind: str, options: dict) -> None:
    """Blocks outside the layout hold no allowed pair (otherwise the kernel would silently drop them)."""
    core = make_core(kind, False, options)
    length, block = 90, options["block_size"]
    n_blocks = math.ceil(length / block)
    for causal in (False, True):
        mask = P.reference_mask(core.pattern, n_blocks * block, block, causal, n_heads=4)
        touched = mask.view(4, n_blocks, block, n_blocks, block).any(-1).any(2)
        layout = core.pattern.layout(n_blocks, n_blocks, block, causal).expand(4, -1, -1)
        assert not (touched & ~layout).any()


def test_cost_grows_with_the_pattern_not_the_square() -> None:
    """Local attention's non-zero blocks grow linearly in T; row groups keep padding within 2x."""
    band = P.Band(16)
    counts = [build_plan(band, n, 16, True, 1, 1, torch.device("cpu")).nonzero_blocks for n in (256, 512, 1024)]
    assert counts[2] - counts[1] == 2 * (counts[1] - counts[0])  # linear in T
    assert counts[2] < 3 * 1024 // 16
    bigbird = P.Band(16) | P.Global(16) | P.RandomBlocks(2, 0)
    plan = build_plan(bigbird, 2048, 16, False, 1, 1, torch.device("cpu"))
    padded = sum(g.key_blocks.numel() for g in plan.groups)
    assert padded <= 2 * plan.nonzero_blocks
    assert plan.nonzero_blocks < 0.1 * (2048 // 16) ** 2


def test_random_pattern_is_seeded() -> None:
    a = P.RandomBlocks(3, seed=7).layout(20, 20, 16, False)
    b = P.RandomBlocks(3, seed=7).layout(20, 20, 16, False)
    c = P.RandomBlocks(3, seed=8).layout(20, 20, 16, False)
    assert torch.equal(a, b) and not torch.equal(a, c)
    causal = P.RandomBlocks(3, seed=7).layout(20, 20, 16, True)[0]
    assert not causal.triu(1).any()


def test_causal_never_sees_the_future() -> None:
    core = make_core("bigbird", True, {"window": 6, "global_tokens": 3, "block_size": 8})
    q, k, v = random_qkv(1, 4, 40, 16)
    out = core(q, k, v, causal=True)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 30:] += 5.0
    v2[:, :, 30:] -= 3.0
    out2 = core(q, k2, v2, causal=True)
    torch.testing.assert_close(out[:, :, :30], out2[:, :, :30], atol=0, rtol=0)
    assert not torch.allclose(out[:, :, 30:], out2[:, :, 30:])


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="window"):
        make_core("local", True, {"window": 0})
    with pytest.raises(ConfigError, match="decoder|encoder"):
        make_core("star", True)
