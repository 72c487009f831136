"""The collectives' working buffers (:mod:`xscale.estimate.collective_memory`) and where the planner adds them."""

from __future__ import annotations

import dataclasses

import pytest

from xscale.config.load import load_config
from xscale.estimate.cluster import Cluster, LinkCost
from xscale.estimate.collective_memory import collective_buffer_bytes, largest_messages
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import placement
from xscale.estimate.search import Planner

TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.d_ff=64",
        "model.ffn=gelu", "model.tie_embeddings=false", "train.seq_len=16", "train.global_batch_size=8",
        "train.precision=bf16", "parallel.bucket_mb=0.01"]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
RATIOS = (("all_reduce", 0.5), ("all_gather", 1.0), ("reduce_scatter", 2.0))


def _cluster(ratios: tuple = RATIOS) -> Cluster:
    links = {name: LinkCost(0.0, 100e9) for name in COLLECTIVES}
    return Cluster("round", 8, 80 * 2**30, 1e12, {"bf16": 1e12, "fp32": 1e11}, ((1.0, 1.0),),
                   {"intra_node": links, "inter_node": dict(links)}, collective_buffers=ratios)


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_config(overrides=TINY))


def _where(shape, layout):
    return placement(layout.apply(shape.config))


def test_each_layout_issues_its_collectives(shape):
    bucket = 0.01 * 2**20
    assert largest_messages(shape, Layout(), _where(shape, Layout()), 0) == {}
    ddp = Layout(dp=2, micro_batch=4)
    assert largest_messages(shape, ddp, _where(shape, ddp), 0) == {"all_reduce": bucket}
    zero1 = dataclasses.replace(ddp, zero_stage=1)
    assert largest_messages(shape, zero1, _where(shape, zero1), 0) == {"reduce_scatter": bucket, "all_gather": bucket}
    zero3 = dataclasses.replace(ddp, zero_stage=3)
    block = shape.blocks[0].held  # one block's bf16 parameters gathered, its fp32 gradients reduce-scattered
    assert largest_messages(shape, zero3, _where(shape, zero3), 0) == {"all_gather": 2 * block,
                                                                      "reduce_scatter": 4 * block}
    tp = Layout(tp=2, micro_batch=8, sequence_parallel=True)  # 8 x 16 tokens x 32 bf16 activations
    assert largest_messages(shape, tp, _where(shape, tp), 0) == {"reduce_scatter": 8192.0, "all_gather": 8192.0}
    assert collective_buffer_bytes(shape, _cluster(), zero1, _where(shape, zero1)) == pytest.approx(3 * bucket)
    assert collective_buffer_bytes(shape, _cluster(()), zero1, _where(shape, zero1)) == 0.0


def test_the_planner_adds_them_to_the_peak(shape):
    layout = Layout(dp=2, zero_stage=1, micro_batch=4)
    with_buffers = Planner(shape, _cluster(), 2).predict(layout).peak_bytes
    without = Planner(shape, _cluster(()), 2).predict(layout).peak_bytes
    assert with_buffers - without == pytest.approx(3 * 0.01 * 2**20)
