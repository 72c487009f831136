"""The memory-lean block-sparse path (online softmax forward, recomputing backward) against the gathering path."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import make_core, random_qkv
from xscale.models.attention import block_sparse
from xscale.models.attention.block_sparse import gathered_block_sparse_attention

CASES = [
    ("local", {"window": 12, "block_size": 8}),
    ("dilated", {"window": 3, "dilation": 3, "block_size": 8}),
    ("longformer", {"window": 6, "global_tokens": 3, "block_size": 8}),
    ("bigbird", {"window": 6, "global_tokens": 9, "random_blocks": 2, "block_size": 8}),
]


def _both_paths(kind: str, options: dict, causal: bool, kv_heads: int | None = None):
    core = make_core(kind, causal, options, n_kv_heads=kv_heads)
    q, k, v = random_qkv(2, 4, 45, 16, kv_heads=kv_heads)  # 45: not a multiple of the block
    plan = core.plan(45, causal, 4, k.shape[1], q.device, q.dtype)
    online = core(q, k, v, causal=causal)
    gathered = gathered_block_sparse_attention(q, k, v, plan, options["block_size"])
    grad = torch.randn_like(online)
    return (online, *torch.autograd.grad(online, (q, k, v), grad)), \
        (gathered, *torch.autograd.grad(gathered, (q, k, v), grad))


@pytest.mark.parametrize("tile", [64, 200, 1 << 20], ids=["one-block-tiles", "three-block-spans", "one-tile"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kind,options", CASES, ids=[c[0] for c in CASES])
def test_online_equals_gathered(kind: str, options: dict, causal: bool, tile: int, monkeypatch) -> None:
    """Output and q/k/v gradients, whatever the tiling (rows split, key blocks split into several spans)."""
    monkeypatch.setattr(block_sparse, "TILE_ELEMENTS", tile)
    online, gathered = _both_paths(kind, options, causal)
    for mine, reference in zip(online, gathered):
        torch.testing.assert_close(mine, reference, atol=1e-10, rtol=1e-10)


def test_online_grouped_kv_heads(monkeypatch) -> None:
    """Grouped kv heads: dK/dV gather the contributions of every query head that shares them."""
    monkeypatch.setattr(block_sparse, "TILE_ELEMENTS", 64)
    online, gathered = _both_paths("bigbird", {"window": 6, "global_tokens": 3, "block_size": 8}, True, kv_heads=2)
    for mine, reference in zip(online, gathered):
        torch.testing.assert_close(mine, reference, atol=1e-10, rtol=1e-10)


def test_saves_only_output_and_row_statistics() -> None:
    """Autograd keeps q, k, v, the output and one log-sum-exp per row: nothing that grows with the layout."""
    options = {"window": 32, "global_tokens": 16, "random_blocks": 2, "block_size": 16}
    core = make_core("bigbird", True, options, max_seq_len=256)
    q, k, v = random_qkv(1, 4, 256, 16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = core(q, k, v, causal=True)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
             if t.untyped_storage().data_ptr() not in inputs}
    assert sum(extra.values()) <= out.numel() * out.element_size() * (1 + 1 / 16) + 1024
    assert out.grad_fn.name().startswith("OnlineBlockSparse")


def test_dropout_takes_the_gathering_path() -> None:
    """Training with attention dropout keeps the gathered probabilities (their dropout masks index them)."""
    core = make_core("local", True, {"window": 12, "block_size": 8})
    core.dropout.p = 0.5
    core.train()
    q, k, v = random_qkv(1, 4, 32, 16)
    out = core(q, k, v, causal=True)
    assert not out.grad_fn.name().startswith("OnlineBlockSparse")


@pytest.mark.parametrize("tile", [64, 1000], ids=["one-block-tiles", "three-row-tiles"])
def test_band_rows_read_sliding_window_views(tile: int, monkeypatch) -> None:
    """A band's rows read K and V as overlapping views (no gather) and still match the gathering path."""
    monkeypatch.setattr(block_sparse, "TILE_ELEMENTS", tile)
    starts = []
    window_start = block_sparse._window_start
    monkeypatch.setattr(block_sparse, "_window_start",
                        lambda group, rows: starts.append(window_start(group, rows)) or starts[-1])
    online, gathered = _both_paths("local", {"window": 16, "block_size": 8}, True)
    assert any(s is not None for s in starts)
    if tile == 1000:  # rows 0-2 of a head list blocks 0-2 (a clipped band): that tile gathers
        assert any(s is None for s in starts)
    for mine, reference in zip(online, gathered):
        torch.testing.assert_close(mine, reference, atol=1e-10, rtol=1e-10)
