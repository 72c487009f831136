"""Shared helpers for the attention-core tests: tiny configs, random q/k/v, the dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xscale.config.schema import AttentionConfig, ModelConfig
from xscale.models import build_model
from xscale.models.attention.core import AttentionCore, build_core


def make_core(kind: str, causal: bool, options: dict | None = None, n_heads: int = 4, d_model: int = 64,
              max_seq_len: int = 64, n_kv_heads: int | None = None) -> AttentionCore:
    config = ModelConfig(n_heads=n_heads, d_model=d_model, max_seq_len=max_seq_len, n_kv_heads=n_kv_heads)
    return build_core(kind, config, 0, options or {}, causal, False).double()


def random_qkv(batch: int, heads: int, length: int, head_dim: int, scale: float = 1.0, kv_heads: int | None = None,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, length, head_dim)] + [(batch, kv_heads or heads, length, head_dim)] * 2
    return tuple(
        (torch.randn(s, generator=generator, dtype=torch.float64) * (scale if i < 2 else 1.0)).requires_grad_()
        for i, s in enumerate(shapes)
    )


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA with a boolean mask; rows with no allowed key give zeros (the cores' convention)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if causal:
        tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        mask = tril if mask is None else mask & tril
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1, keepdim=True), out, 0.0)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).detach().norm() / ref.detach().norm())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_loss_falls(kind: str, options: dict | None = None, family: str = "decoder", steps: int | None = None,
                      **model: object) -> None:
    """A tiny model with attention ``kind`` trained ``steps`` AdamW steps on eight fixed periodic sequences
    (period 4; an encoder predicts 20% masked tokens): the mean of the last 5 losses falls below 0.6 x the first 5.
    ``steps``: 40 for a decoder, 80 for an encoder (fewer tokens carry a loss) unless given."""
    steps = steps or (40 if family == "decoder" else 80)
    vocab, length, batch = 32, 16, 8
    config = ModelConfig(**(dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=length,
                                 family=family, attention=AttentionConfig(kind=kind, options=options or {}))
                            | ({"position": "learned"} if family == "encoder" else {}) | model))
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared machine: more threads only add synchronisation
    try:
        losses = _train(build_model(config, seed=1), family, steps, vocab, length, batch)
    finally:
        torch.set_num_threads(threads)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"{kind}: loss went from {first:.3f} to {last:.3f}"


def _train(net: torch.nn.Module, family: str, steps: int, vocab: int, length: int, batch: int) -> list[float]:
    """``steps`` AdamW steps (lr 1e-2) on the periodic sequences; the losses."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    period = torch.randint(3, vocab, (batch, 4), generator=torch.Generator().manual_seed(0))
    tokens = period.repeat(1, length // 4 + 1)[:, : length + 1]
    losses = []
    for step in range(steps):
        if family == "decoder":
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
        else:
            inputs, labels = tokens[:, :-1].clone(), torch.full((batch, length), -100)
            masked = torch.rand(batch, length, generator=torch.Generator().manual_seed(step)) < 0.2
            labels[masked] = inputs[masked]
            inputs[masked] = 2
        logits = net(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses
