"""``train.sparse_attention=flex``: the position-sparse cores through FlexAttention, the pattern's block layout as the
``BlockMask`` and its token rule as ``mask_mod``, against the gathered path on the same q, k, v.

FlexAttention trains on CUDA only; on the CPU it runs forward, eagerly (``mask_mod`` evaluated on every pair, the
block tables ignored) or compiled (the block tables decide which blocks run): both are checked here, the backward on
the GPU tier (tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.models.attention.conftest import make_core
from xscale.models import build_model
from xscale.models.attention.sparse import PatternAttention
from xscale.models.registry import ATTENTION
from xscale.ops.flex_block_sparse import flex_attention_with

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

LENGTH = 300  # three 128-token kernel tiles, the last partial; 19 pattern blocks of 16, the last partial
OPTIONS = {
    "local": {"window": 20},
    "block_local": {},
    "dilated": {"window": 4, "dilation": 3},
    "strided": {},
    "fixed": {},
    "global": {},
    "random": {"random_blocks": 2},
    "longformer": {"window": 20, "global_tokens": 9},
    "bigbird": {"window": 20, "global_tokens": 9, "random_blocks": 2},
    "star": {},  # encoder only
    "axial": {},
}


def _qkv(kv_heads: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, LENGTH, 16, generator=generator),
            *(torch.randn(2, kv_heads, LENGTH, 16, generator=generator) for _ in range(2)))


def _cases():
    for kind in OPTIONS:
        causal_capable = ATTENTION.get(kind).causal_capable
        for causal in (True, False) if causal_capable else (False,):
            yield pytest.param(kind, causal, id=f"{kind}-{'causal' if causal else 'bidir'}")


def _flex_and_gathered(kind: str, causal: bool, compiled: bool, kv_heads: int = 4, layer: int = 0):
    core = make_core(kind, causal, {**OPTIONS[kind], "block_size": 16}, max_seq_len=LENGTH, n_kv_heads=kv_heads)
    core = core.float().eval()
    if layer:
        core.layer_index = layer
        core.pattern = core.make_pattern()
    q, k, v = _qkv(kv_heads)
    with torch.no_grad():
        gathered = core(q, k, v, causal=causal)
        flex = flex_attention_with(q, k, v, core.block_mask(LENGTH, causal, 4, q.device), compiled=compiled)
    return flex, gathered


@pytest.mark.parametrize("kind,causal", list(_cases()))
def test_every_pattern_through_flex_masks_equals_the_gathered_core(kind, causal):
    """Eager FlexAttention evaluates mask_mod on every (query, key): the token rule, the listed blocks, causality
    and the sequence end together give the gathered core's output."""
    flex, gathered = _flex_and_gathered(kind, causal, compiled=False)
    torch.testing.assert_close(flex, gathered, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,causal,kv_heads", [("bigbird", True, 2), ("fixed", False, 4)],
                         ids=["bigbird-causal-gqa", "fixed-bidir-split-heads"])
def test_compiled_flex_runs_only_the_listed_blocks_and_still_equals_the_gathered_core(kind, causal, kv_heads):
    """Compiled, FlexAttention visits only the BlockMask's blocks: a block the tables missed would drop its keys.
    A second layer (another random draw) reuses the compiled kernel: its rule's tables are inputs, not constants."""
    flex, gathered = _flex_and_gathered(kind, causal, compiled=True, kv_heads=kv_heads)
    torch.testing.assert_close(flex, gathered, atol=2e-5, rtol=1e-4)
    graphs = counters["stats"]["unique_graphs"]
    flex, gathered = _flex_and_gathered(kind, causal, compiled=True, kv_heads=kv_heads, layer=3)
    torch.testing.assert_close(flex, gathered, atol=2e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs, "a second layer's mask recompiled the kernel"


@pytest.mark.slow
@pytest.mark.parametrize("kind,causal", list(_cases()))
def test_every_pattern_through_compiled_flex_equals_the_gathered_core(kind, causal):
    flex, gathered = _flex_and_gathered(kind, causal, compiled=True)
    torch.testing.assert_close(flex, gathered, atol=2e-5, rtol=1e-4)


def test_flex_is_taken_by_cuda_tensors_only():
    """On the CPU a core set to flex runs the gathered path (FlexAttention has no CPU backward) and builds no mask."""
    core = make_core("bigbird", True, {**OPTIONS["bigbird"], "block_size": 16}, max_seq_len=LENGTH).float()
    q, k, v = (t.requires_grad_() for t in _qkv())
    want = core(q, k, v, causal=True)
    core.sparse_attention = "flex"
    got = core(q, k, v, causal=True)
    assert torch.equal(got, want) and core._block_masks == {}
    got.sum().backward()


def test_use_kernels_sets_the_sparse_attention_of_every_pattern_core():
    from xscale.config.schema import AttentionConfig, ModelConfig

    attention = AttentionConfig(kind="longformer", options={"window": 4, "global_tokens": 2, "block_size": 8})
    config = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, attention=attention)
    model = build_model(config).use_kernels("torch", "flex")
    cores = [m for m in model.modules() if isinstance(m, PatternAttention)]
    assert len(cores) == 2 and all(core.sparse_attention == "flex" for core in cores)
    with pytest.raises(ValueError, match="train.sparse_attention"):
        model.use_kernels("torch", "triton")


def test_flex_with_compiled_blocks_is_refused_with_the_fix():
    from xscale.config.load import load_config
    from xscale.config.schema import ConfigError

    assert load_config(None, ["train.sparse_attention=flex"]).train.sparse_attention == "flex"
    with pytest.raises(ConfigError, match="train.compile=false, or train.sparse_attention=gather"):
        load_config(None, ["train.sparse_attention=flex", "train.compile=true"])
    with pytest.raises(ConfigError, match="not one of gather, flex"):
        load_config(None, ["train.sparse_attention=triton"])
