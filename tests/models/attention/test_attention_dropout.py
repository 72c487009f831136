"""Attention dropout is layout-independent in every core: a tensor-parallel rank's heads and a data-parallel
rank's samples draw their slice of the single device's masks (:mod:`xscale.models.dropout`), the block-sparse
kernel drops the gathered probabilities at their global (sample, head, query, key) position, and no core draws
attention dropout from torch's RNG."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.models.attention.conftest import make_core, random_qkv
from tests.models.attention.test_in_model import SMALL_OPTIONS
from xscale.config.load import load_config
from xscale.config.schema import AttentionConfig, ModelConfig
from xscale.models import build_model
from xscale.models.attention import patterns as P
from xscale.models.attention.core import AttentionCore, unused_attention_dropout
from xscale.models.registry import ATTENTION
from xscale.runtime import StepContext

P_DROP = 0.3
POSITION = StepContext(seed=5, step=2)
HEADS, LENGTH = 4, 37

# The cores that drew attention dropout from torch's RNG before (F.dropout, SDPA's dropout_p), and dense.
CASES = [
    ("dense", True, {}),
    ("longformer", False, {"window": 6, "global_tokens": 3, "block_size": 8}),
    ("bigbird", True, {"window": 6, "global_tokens": 3, "random_blocks": 2, "block_size": 8}),
    ("local", True, {"window": 5, "block_size": 8}),
    ("gaussian", True, {}),
    ("adaptive_span", False, {"max_span": 16, "ramp": 4}),
    ("inducing", False, {"inducing_points": 5}),
    ("luna", False, {"packed_length": 5}),
    ("linformer", False, {"projected_length": 7}),
    ("memory_compressed", False, {}),
    ("memory_compressed", True, {}),
]


def _core(kind: str, causal: bool, options: dict) -> AttentionCore:
    core = make_core(kind, causal, options, n_heads=HEADS)
    core.dropout.p, core.dropout.site = P_DROP, 11
    with torch.no_grad():
        for parameter in core.parameters():  # some cores leave their state to the model's initialiser
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    return core.train()


def _head_shard(core: AttentionCore, rank: int, heads: int) -> AttentionCore:
    """What a tensor-parallel rank holds: heads [rank * heads, (rank + 1) * heads) of the per-head state."""
    shard = copy.deepcopy(core)
    for name in shard.per_head_state:
        setattr(shard, name, nn.Parameter(getattr(core, name)[rank * heads:(rank + 1) * heads].detach().clone()))
    return shard


def _run(core: AttentionCore, q, k, v, causal: bool, position: StepContext = POSITION) -> torch.Tensor:
    return core(q, k, v, causal=causal, context=position)


@pytest.mark.parametrize("kind,causal,options", CASES, ids=[f"{k}-{'causal' if c else 'bidir'}" for k, c, _ in CASES])
def test_head_and_batch_slices_draw_the_whole_mask(kind: str, causal: bool, options: dict) -> None:
    core = _core(kind, causal, options)
    q, k, v = random_qkv(4, HEADS, LENGTH, 16)
    whole = _run(core, q, k, v, causal)
    with torch.no_grad():
        plain = core.eval()(q, k, v, causal=causal)
    core.train()
    assert not torch.allclose(whole, plain, atol=1e-3), "attention dropout must change the output"
    other_step = _run(core, q, k, v, causal, StepContext(seed=5, step=3))
    assert not torch.allclose(whole, other_step, atol=1e-3), "the mask must change with the step"

    half = HEADS // 2
    grad = torch.randn_like(whole)
    whole_grads = torch.autograd.grad(whole, (q, k, v), grad)
    for rank in range(2):  # tensor parallelism: each rank its heads, numbered from shard_index * half
        heads = slice(rank * half, (rank + 1) * half)
        parts = tuple(x[:, heads].detach().requires_grad_() for x in (q, k, v))
        out = _run(_head_shard(core, rank, half), *parts, causal, POSITION.with_tensor_parallel(rank, 2))
        torch.testing.assert_close(out, whole[:, heads], atol=1e-12, rtol=1e-12)
        for got, want in zip(torch.autograd.grad(out, parts, grad[:, heads]), whole_grads):
            torch.testing.assert_close(got, want[:, heads], atol=1e-12, rtol=1e-12)
    # data parallelism (or a microbatch): rows 1, 2 of the global batch
    rows = _run(core, *(x[1:3] for x in (q, k, v)), causal, StepContext(seed=5, step=2, first_sample=1))
    torch.testing.assert_close(rows, whole[1:3], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind,causal,options", [c for c in CASES if c[0] in ("longformer", "bigbird", "local")])
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_block_sparse_drops_what_dense_attention_would(kind: str, causal: bool, options: dict, kv_heads: int) -> None:
    """The gathered probabilities are masked at (sample, head, query, key): the dense (B, H, T, T) mask."""
    core = _core(kind, causal, options)
    q, k, v = random_qkv(3, HEADS, LENGTH, 16, kv_heads=kv_heads)
    out = _run(core, q, k, v, causal)
    visible = P.reference_mask(core.pattern, LENGTH, options["block_size"], causal, n_heads=HEADS)
    if causal:
        visible = visible & torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    groups = HEADS // kv_heads
    keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ keys.transpose(-1, -2) / 4).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    keep = core.dropout.keep_mask(probs.shape, probs.device, POSITION)
    torch.testing.assert_close(out, (probs * keep / (1 - P_DROP)) @ values, atol=1e-10, rtol=1e-10)


def _kinds():
    seen = set()
    for kind in ATTENTION.names():
        cls = ATTENTION.get(kind)
        if cls not in seen:
            seen.add(cls)
            yield pytest.param(kind, "decoder" if cls.causal_capable else "encoder", id=kind)


@pytest.mark.parametrize("kind,family", list(_kinds()))
def test_no_core_draws_attention_dropout_from_torchs_rng(kind: str, family: str) -> None:
    """Under a dropout position a training step's output does not depend on torch's generator (cores that
    still did would need ``rng_dropout = True``, which makes ``xscale parity`` refuse them)."""
    config = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                         attention_dropout=P_DROP, attention=AttentionConfig(kind=kind, options=dict(SMALL_OPTIONS)))
    model = build_model(config, seed=0).train()
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outputs.append(model(tokens, context=POSITION))
    assert ATTENTION.get(kind).rng_dropout or torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_routing_attention_drops_by_global_position(causal: bool) -> None:
    """Routing attention gathers each query block's keys into a window whose width W is the widest over the
    samples and heads a rank holds: the probabilities are dropped at (sample, head, query, key), not at their slot
    of that window, so head shards (tp) and row slices (dp, microbatches) draw the whole run's masks."""
    fresh = _core("routing", causal, {"clusters": 3, "window": 4})  # every run starts from the same centroids
    q, k, v = random_qkv(4, HEADS, LENGTH, 16, seed=1)
    whole = _run(copy.deepcopy(fresh), q, k, v, causal)
    with torch.no_grad():
        plain = copy.deepcopy(fresh).eval()(q, k, v, causal=causal)
    assert not torch.allclose(whole, plain, atol=1e-3), "attention dropout must change the output"
    half = HEADS // 2
    for rank in range(2):
        heads = slice(rank * half, (rank + 1) * half)
        out = _run(_head_shard(fresh, rank, half), *(x[:, heads] for x in (q, k, v)), causal,
                   POSITION.with_tensor_parallel(rank, 2))
        torch.testing.assert_close(out, whole[:, heads], atol=1e-12, rtol=1e-12)
    for first in range(4):  # each sample alone, as a data-parallel rank or a microbatch of one would hold it
        rows = slice(first, first + 1)
        out = _run(copy.deepcopy(fresh), *(x[rows] for x in (q, k, v)), causal,
                   StepContext(seed=5, step=2, first_sample=first))
        torch.testing.assert_close(out, whole[rows], atol=1e-12, rtol=1e-12)


def test_attention_dropout_on_cores_without_probabilities_is_named():
    """model.attention_dropout does nothing on the layers whose cores form no probabilities: one warning names them
    (Luna's causal form only); none when every layer drops or the rate is 0."""
    def warning(*overrides):
        return unused_attention_dropout(load_config(None, ["model.attention_dropout=0.1", *overrides]).model)

    mixed = warning("model.attention.per_layer=[dense,linear,performer]", "model.n_layers=3")
    assert mixed is not None and "no effect on the layers with attention linear, performer" in mixed
    assert warning("model.attention.kind=dense") is None
    assert warning("model.attention.kind=luna") is not None
    assert warning("model.attention.kind=luna", "model.family=encoder") is None
    assert unused_attention_dropout(load_config(None, ["model.attention.kind=linear"]).model) is None
