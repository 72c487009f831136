"""Transformer-XL segment recurrence (Dai et al. 2019, sec. 3.2): a layer over [SG(memory) ; segment]."""

from __future__ import annotations

import pytest
import torch

from xscale.config.check import validate
from xscale.config.schema import AttentionConfig, Config, ConfigError, ModelConfig
from xscale.models.attention.core import NoOptions
from xscale.models.attention.dense import DenseAttention
from xscale.models.attention.linear import elu_feature
from xscale.models.block import TransformerBlock
from xscale.models.init import init_weights
from xscale.models.position import RotaryPosition
from xscale.models.positions.xl import TransformerXLPosition, relative_sinusoid
from xscale.models.segment_memory import SegmentMemory, check_segment_memory_config
from xscale.models.transformer import Transformer
from xscale.runtime import StepContext

D, HEADS, T = 16, 2, 6


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=64, d_model=D, n_layers=2, n_heads=HEADS, max_seq_len=32, position="xl",
                segment_memory=T)
    return ModelConfig(**{**base, **changes})


def block_and_position(config: ModelConfig) -> tuple[TransformerBlock, TransformerXLPosition]:
    torch.manual_seed(0)
    block = TransformerBlock(config, 0, causal=True, uses_bias=True)
    position = TransformerXLPosition(config.d_model, config.n_heads, config.head_dim, config.max_seq_len, True)
    for parameter in list(block.parameters()) + list(position.parameters()):
        torch.nn.init.normal_(parameter, std=0.3)
    return block.eval(), position


def reference_attention(block: TransformerBlock, position: TransformerXLPosition, memory: torch.Tensor,
                        x: torch.Tensor) -> torch.Tensor:
    """By hand: softmax over all M + T keys with the xl terms and the shifted causal mask; the last T rows."""
    attention, norm = block.attention.sublayer, block.attention.norm
    whole = norm(torch.cat([memory, x], dim=1))
    queries = whole[:, -x.shape[1]:]
    heads = lambda t: t.view(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attention.wq(queries)), heads(attention.wk(whole)), heads(attention.wv(whole))
    total, length = whole.shape[1], x.shape[1]
    i = torch.arange(total - length, total)[:, None]
    j = torch.arange(total)[None, :]
    rows = relative_sinusoid((i - j).flatten(), D)  # R_{i-j} for every (i, j)
    position_keys = (rows @ position.position_keys.T).view(length, total, HEADS, -1).permute(2, 0, 1, 3)
    scale = (D // HEADS) ** -0.5
    logits = (q @ k.transpose(-1, -2)
              + torch.einsum("bhid,hijd->bhij", q + position.v[None, :, None], position_keys)
              + torch.einsum("hd,bhjd->bhj", position.u, k)[:, :, None]) * scale
    logits = logits.masked_fill(j > i, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    attended = attention.wo(out.transpose(1, 2).reshape(x.shape[0], length, D))
    return x + attended


def test_layer_with_memory_matches_full_attention_over_memory_and_segment():
    block, position = block_and_position(tiny())
    memory, x = torch.randn(2, 4, D), torch.randn(2, T, D)
    store = SegmentMemory(4)
    store.current["(0, 0)"] = memory
    context = StepContext().with_segment_memory(store)
    got = block.attention(x, position, context=context, remembered=store.exchange((0, 0), x))
    torch.testing.assert_close(got, reference_attention(block, position, memory, x), rtol=1e-5, atol=1e-5)


def test_no_gradient_flows_into_the_memory():
    block, position = block_and_position(tiny())
    block.train()
    memory = torch.randn(2, T, D, requires_grad=True)
    store = SegmentMemory(T)
    store.current["(0, 0)"] = memory
    x = torch.randn(2, T, D, requires_grad=True)
    out = block(x, position, context=StepContext().with_segment_memory(store))
    out.sum().backward()
    assert memory.grad is None or not memory.grad.any()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert not store.recorded["(0, 0)"].requires_grad


class BandedDense(DenseAttention):
    """Dense attention with a fixed extra logit bias: the reference's band."""

    band: torch.Tensor

    def forward(self, q, k, v, *, causal, bias=None, context=None):
        return super().forward(q, k, v, causal=causal, bias=self.band if bias is None else bias + self.band,
                               context=context)


def banded_forward(model: Transformer, tokens: torch.Tensor, segment: int, memory: int) -> torch.Tensor:
    """The whole window at once, query i of segment s = i // segment seeing keys s * segment - memory .. i: what
    segment-by-segment recurrence computes when each layer remembers ``memory`` of its inputs."""
    length = tokens.shape[1]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    band = torch.zeros(length, length).masked_fill(j < (i // segment) * segment - memory, float("-inf"))
    attentions = [block.attention.sublayer for block in model.stack.blocks()]
    originals = [attention.core for attention in attentions]
    for attention in attentions:
        attention.core = BandedDense(model.config, attention.core.layer_index, NoOptions())
        attention.core.band = band
    try:
        return model(tokens)
    finally:
        for attention, original in zip(attentions, originals):
            attention.core = original


def test_three_segments_equal_one_window_restricted_to_the_band():
    """M = T: each segment with the previous one remembered = the 3T window where a query of segment s sees the
    keys from the start of segment s - 1 (the band)."""
    config = tiny()
    model = Transformer(config).eval()
    init_weights(model, config, seed=1)
    for parameter in model.stack.position.parameters():  # relative positions that show (u, v start at 0)
        torch.nn.init.normal_(parameter, std=0.3, generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(0, 64, (2, 3 * T), generator=torch.Generator().manual_seed(2))
    store = SegmentMemory(T)
    context = StepContext().with_segment_memory(store)
    with torch.no_grad():
        segments = []
        for start in range(0, 3 * T, T):
            segments.append(model(tokens[:, start:start + T], context=context))
            store.advance()
        whole = banded_forward(model, tokens, segment=T, memory=T)
    torch.testing.assert_close(torch.cat(segments, dim=1), whole, rtol=1e-4, atol=1e-4)


def test_memory_keeps_the_last_m_inputs_across_short_segments():
    store = SegmentMemory(5)
    for step in range(3):
        store.exchange("layer", torch.full((1, 2, 1), float(step)))
        store.advance()
    assert store.current["layer"].flatten().tolist() == [0.0, 1.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("change, words", [
    ({"model": {"position": "learned"}}, "model.position=xl"),
    ({"model": {"family": "encoder", "position": "xl"}}, "model.family=decoder"),
    ({"model": {"attention": {"kind": "nystrom"}}}, "cannot take the memory"),
    ({"model": {"attention": {"kind": "linear"}}}, "set model.position=rope"),
    ({"model": {"attention": {"kind": "local"}, "position": "rope", "compressed_memory": 4}},
     "model.attention.kind=dense"),
    ({"data": {"order": "shuffled"}}, "data.order=streams"),
    ({"parallel": {"pp": 2}}, "parallel.pp"),
    ({"parallel": {"cp": 2}}, "parallel.cp"),
    ({"model": {"share_layers": True}}, "model.share_layers"),
    ({"model": {"stack": "reversible"}}, "does not combine with model.stack=reversible"),
])
def test_refusals_name_what_to_change(change, words):
    config = Config()
    config.model.position, config.model.segment_memory, config.data.order = "xl", 4, "streams"
    for section, values in change.items():
        for key, value in values.items():
            target = getattr(config, section)
            if isinstance(value, dict):
                for inner, item in value.items():
                    setattr(getattr(target, key), inner, item)
            else:
                setattr(target, key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check_segment_memory_config(config)


@pytest.mark.parametrize("position, kind", [("xl", "dense"), ("rope", "dense"), ("rope", "local"),
                                            ("rope", "linear"), ("rope", "performer")])
def test_a_valid_memory_config_passes_validation(position, kind):
    config = Config()
    config.model.position, config.model.segment_memory, config.data.order = position, 4, "streams"
    config.model.attention.kind = kind
    validate(config)


def rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE by hand (Su et al. 2021): pairs (i, i + d/2) turned by position * 10000^(-2i/d)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].double() * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.mark.parametrize("kind", ["local", "linear"])
def test_layer_with_memory_and_rope_matches_the_core_written_out(kind):
    """A layer of a core without a logit bias over [SG(memory) ; segment] with RoPE: the queries rotated at positions
    M .. M + T - 1, the keys at 0 .. M + T - 1, and (by hand) the band's softmax or the linear causal sum."""
    memory_length, window = 4, 3
    config = tiny(position="rope", segment_memory=memory_length,
                  attention=AttentionConfig(kind=kind, options={"window": window, "block_size": 4, "chunk": 4}))
    torch.manual_seed(0)
    block = TransformerBlock(config, 0, causal=True).eval()
    position = RotaryPosition(D, HEADS, D // HEADS, config.max_seq_len, True)
    memory, x = torch.randn(2, memory_length, D), torch.randn(2, T, D)
    store = SegmentMemory(memory_length)
    store.current["(0, 0)"] = memory
    got = block.attention(x, position, context=StepContext().with_segment_memory(store),
                          remembered=store.exchange((0, 0), x))

    attention, total = block.attention.sublayer, memory_length + T
    whole = block.attention.norm(torch.cat([memory, x], dim=1))
    heads = lambda t: t.view(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)  # noqa: E731
    q = rotated(heads(attention.wq(whole[:, -T:])), torch.arange(memory_length, total))
    k = rotated(heads(attention.wk(whole)), torch.arange(total))
    v = heads(attention.wv(whole))
    back = torch.arange(memory_length, total)[:, None] - torch.arange(total)[None, :]  # (i + M) - j
    if kind == "local":
        logits = (q @ k.transpose(-1, -2)) * (D // HEADS) ** -0.5
        out = torch.softmax(logits.masked_fill((back < 0) | (back > window), float("-inf")), dim=-1) @ v
    else:
        weights = (elu_feature(q) @ elu_feature(k).transpose(-1, -2)) * (back >= 0)
        out = (weights @ v) / weights.sum(-1, keepdim=True)
    expected = x + attention.wo(out.transpose(1, 2).reshape(2, T, D))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
