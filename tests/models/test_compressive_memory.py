"""The Compressive Transformer's compressed memory (Rae et al. 2020): f_c, the memory layout, the reconstruction loss."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.attention import Attention
from xscale.models.compressive_memory import MemoryCompression, content_attention, reconstruction_loss
from xscale.models.init import init_weights
from xscale.models.segment_memory import SegmentMemory, check_segment_memory_config
from xscale.models.transformer import Transformer
from xscale.runtime import StepContext

D = 16


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=64, d_model=D, n_layers=2, n_heads=2, max_seq_len=64, position="xl", segment_memory=4,
                compressed_memory=4, compression_rate=2)
    return ModelConfig(**{**base, **changes})


def test_mean_compression_pools_c_states_at_a_time():
    states = torch.arange(12.0).view(1, 6, 2)
    pooled = MemoryCompression(tiny(compression="mean"))(states)
    torch.testing.assert_close(pooled, torch.tensor([[[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]]))
    assert MemoryCompression(tiny(compression="conv", compression_rate=3))(torch.randn(2, 6, D)).shape == (2, 2, D)


def test_states_leaving_the_memory_are_compressed_and_attended_before_it():
    """Memory 4, compressed 4, rate 2, segments of 2: [compressed ; memory] as the paper lays them out."""
    memory, compress = SegmentMemory(4, 4), MemoryCompression(tiny(compression="mean"))
    seen = []
    for step in range(5):
        segment = torch.full((1, 2, 1), float(step))
        seen.append(memory.exchange("layer", segment))
        if (leaving := memory.leaving("layer")) is not None:
            memory.record_compressed("layer", compress(leaving))
        memory.advance()
    assert seen[0] is None and seen[2].flatten().tolist() == [0, 0, 1, 1]
    assert seen[3].flatten().tolist() == [0, 1, 1, 2, 2]  # step 0's states compressed to one, then the memory
    assert seen[4].flatten().tolist() == [0, 1, 2, 2, 3, 3]
    assert memory.current["layer/compressed"].flatten().tolist() == [0, 1, 2]


def test_reconstruction_loss_trains_only_the_compression():
    config = tiny(compression="conv")
    torch.manual_seed(0)
    attention, compress = Attention(config, 0, causal=True), MemoryCompression(config)
    queries, old = torch.randn(2, 4, D, requires_grad=True), torch.randn(2, 6, D)  # the memory: no graph
    loss = reconstruction_loss(attention, queries, old, compress(old))
    main = [attention.wq.weight, attention.wk.weight, attention.wv.weight, queries]
    grads = torch.autograd.grad(loss, [*main, compress.conv.weight], allow_unused=True)
    assert all(grad is None for grad in grads[:-1])  # stop-gradient into the main network and the memories
    assert grads[-1] is not None and grads[-1].abs().sum() > 0
    exact = reconstruction_loss(attention, queries, old, old)
    assert float(exact) == 0.0 and content_attention(attention, queries, old).shape == (2, 2, 4, D // 2)


def test_model_attends_over_compressed_memory_and_the_loss_reaches_f_c():
    config = tiny()
    model = Transformer(config)
    init_weights(model, config, seed=0)
    memory = SegmentMemory(config.segment_memory, config.compressed_memory)
    context = StepContext().with_segment_memory(memory)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    for start in range(0, 12, 4):  # the third segment reads [2 compressed ; 4 remembered ; 4]
        model.zero_grad()
        logits = model(tokens[:, start:start + 4], context=context)
        (logits * 0).sum().backward()  # only the auxiliary loss sends a gradient
        memory.advance()
    assert memory.current["(0, 0)/compressed"].shape == (2, 4, D)
    conv = model.stack.layers["0"].compression.conv.weight
    assert conv.grad is not None and conv.grad.abs().sum() > 0


@pytest.mark.parametrize("changes, words", [
    ({"compressed_memory": 4, "segment_memory": 0}, "set model.segment_memory > 0"),
    ({"compression_rate": 3}, "multiples of model.compression_rate=3"),
])
def test_refusals_name_what_to_change(changes, words):
    config = Config()
    config.model.position, config.model.segment_memory, config.data.order = "xl", 4, "streams"
    config.model.compressed_memory, config.train.seq_len = 4, 8
    for key, value in changes.items():
        setattr(config.model, key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check_segment_memory_config(config)
    config = Config()
    config.model.position, config.model.segment_memory, config.data.order = "xl", 4, "streams"
    config.model.compressed_memory, config.train.seq_len, config.parallel.tp = 4, 8, 2
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        check_segment_memory_config(config)
