"""Every registered core builds inside the full model and trains a step in the families it allows."""

from __future__ import annotations

import pytest
import torch

from xscale.config import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.registry import ATTENTION

SMALL_OPTIONS = {"block_size": 8, "window": 8, "chunk": 8, "features": 16, "global_tokens": 2, "random_blocks": 1,
                 "buckets": 4, "rounds": 2, "landmarks": 4, "projected_length": 8}


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


@pytest.mark.parametrize("kind,family,allowed", list(_cases()))
def test_builds_and_trains_or_is_refused(kind: str, family: str, allowed: bool) -> None:
    config = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                         attention=AttentionConfig(kind=kind, options=dict(SMALL_OPTIONS)))
    if not allowed:
        with pytest.raises(ConfigError, match=kind):
            build_model(config)
        return
    model = build_model(config)
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 37, 64) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_encoder_decoder_with_a_causal_sparse_core() -> None:
    config = ModelConfig(family="encoder_decoder", vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=48,
                         attention=AttentionConfig(kind="longformer", options=dict(SMALL_OPTIONS)))
    model = build_model(config)
    tokens = torch.randint(0, 64, (2, 21))
    assert model(tokens, tokens).shape == (2, 21, 64)
