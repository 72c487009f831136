"""A layout's predicted peak per rank (:mod:`xscale.estimate.layout_memory`): what full recomputation adds."""

from __future__ import annotations

import pytest

from xscale.config.load import load_config
from xscale.estimate.activations import block_activation_bytes
from xscale.estimate.layout import Layout
from xscale.estimate.layout_memory import rank_peak
from xscale.estimate.memory import fused_loss_chunk_bytes
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import placement

TINY = ["model.vocab_size=2048", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.d_ff=64",
        "model.ffn=gelu", "model.tie_embeddings=false", "train.seq_len=16", "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_config(overrides=TINY))


def _peak(shape, layout):
    config = layout.apply(shape.config)
    return rank_peak(shape, config, layout, placement(config), 0, float(len(shape.blocks)))


@pytest.mark.parametrize("micro_batch", [1, 8])
def test_the_rebuilt_block_and_the_fused_loss_chunk_are_never_alive_together(shape, micro_batch):
    full = _peak(shape, Layout(micro_batch=micro_batch, microbatches=8 // micro_batch, checkpointing="full"))
    rebuilt = block_activation_bytes(shape, shape.blocks[0], micro_batch, "none")
    chunk = fused_loss_chunk_bytes(shape.config, micro_batch * 16)
    stored = len(shape.blocks) * block_activation_bytes(shape, shape.blocks[0], micro_batch, "full")
    assert full.activations == pytest.approx(stored)
    assert full.vocab_parallel_loss == pytest.approx(max(rebuilt, chunk))
    # under tensor parallelism the vocabulary-parallel loss keeps its softmax for the backward: both count
    tp = _peak(shape, Layout(tp=2, micro_batch=micro_batch, microbatches=8 // micro_batch, checkpointing="full",
                             sequence_parallel=True))
    assert tp.activations == pytest.approx((stored + rebuilt) / 2)


def test_a_gtrxl_block_stores_its_two_gates_beside_the_standard_blocks_activations(shape):
    gated = model_shape(load_config(overrides=[*TINY, "model.block=gtrxl", "model.norm_placement=pre"]))
    standard, with_gates = (block_activation_bytes(one, one.blocks[0], 2, "none") for one in (shape, gated))
    assert with_gates - standard == pytest.approx(2 * 12 * 16 * 2 * 32 * 2)  # 2 gates x 12 s b h, fp32 doubles
