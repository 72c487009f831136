"""Every registered core builds inside the full model and trains a step in the families it allows."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.registry import ATTENTION

SMALL_OPTIONS = {"block_size": 8, "window": 8, "chunk": 8, "features": 16, "global_tokens": 2, "random_blocks": 1,
                 "buckets": 4, "rounds": 2, "landmarks": 4, "projected_length": 8, "clusters": 2,
                 "inducing_points": 4, "packed_length": 4, "compression": 3, "max_span": 16, "ramp": 4, "rank": 4}


def _cases():
    seen = set()
    for kind in ATTENTION.names():  # one name per class: aliases build the same core
        cls = ATTENTION.get(kind)
        if cls in seen:
            continue
        seen.add(cls)
        for family in ("decoder", "encoder"):
            allowed = cls.causal_capable if family == "decoder" else cls.bidirectional_capable
            yield pytest.param(kind, family, allowed, id=f"{kind}-{family}")


def _trains_one_step(config: ModelConfig) -> None:
    model = build_model(config)
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 37, 64) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind,family,allowed", list(_cases()))
def test_builds_and_trains_or_is_refused(kind: str, family: str, allowed: bool) -> None:
    config = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                         attention=AttentionConfig(kind=kind, options=dict(SMALL_OPTIONS)))
    if not allowed:
        with pytest.raises(ConfigError, match=kind):
            build_model(config)
        return
    _trains_one_step(config)


VARIANTS = {  # options, positions and head layouts the matrix above does not reach
    "synthesizer-random": dict(kind="synthesizer", options={"mode": "random"}),
    "synthesizer-dense-alibi": dict(kind="synthesizer", position="alibi"),
    "synthesizer-factorized-encoder": dict(kind="synthesizer", options={"mode": "factorized"}, family="encoder"),
    "realformer-alibi": dict(kind="realformer", position="alibi"),
    "gaussian-t5-encoder": dict(kind="gaussian", position="t5_bias", family="encoder"),
    "talking-heads-alibi": dict(kind="talking_heads", position="alibi"),
    "adaptive-span-alibi": dict(kind="adaptive_span", position="alibi"),
    "routing-mqa": dict(kind="routing", n_kv_heads=1, n_heads=4),
    "sinkhorn-gqa-encoder": dict(kind="sinkhorn", n_kv_heads=2, n_heads=4, family="encoder"),
    "luna-mqa": dict(kind="luna", n_kv_heads=1, n_heads=4),
    "memory-compressed-gqa": dict(kind="memory_compressed", n_kv_heads=2, n_heads=4),
    "mixed-layers": dict(kind="dense", per_layer=["routing", "realformer", "sinkhorn", "realformer"], n_layers=4),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains(name: str) -> None:
    variant = dict(VARIANTS[name])
    attention = AttentionConfig(kind=variant.pop("kind"), per_layer=variant.pop("per_layer", None),
                                options=dict(SMALL_OPTIONS) | variant.pop("options", {}))
    layout = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48) | variant
    _trains_one_step(ModelConfig(**layout, attention=attention))


@pytest.mark.parametrize("kind,position", [("luna", "t5_bias"), ("routing", "alibi"), ("sinkhorn", "alibi")])
def test_cores_without_a_logit_bias_refuse_alibi_and_t5(kind: str, position: str) -> None:
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=48, position=position,
                         attention=AttentionConfig(kind=kind, options=dict(SMALL_OPTIONS)))
    with pytest.raises(ConfigError, match="logit bias"):
        build_model(config)
