"""The step's framework costs (:mod:`xscale.estimate.overheads`) and where the step model adds them
(:mod:`xscale.estimate.step_time`), against hand computations."""

from __future__ import annotations

import dataclasses

import pytest

from xscale.config.load import load_config
from xscale.estimate.activations import block_activation_bytes
from xscale.estimate.cluster import Cluster, LinkCost
from xscale.estimate.communication import collective_seconds, tensor_parallel_seconds
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.overheads import (
    block_dispatch_forward_seconds,
    elementwise_forward_seconds,
    loss_forward_seconds,
    step_dispatch_seconds,
)
from xscale.estimate.placement import placement
from xscale.estimate.step_time import microbatch_times, step_time

TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.d_ff=64",
        "model.ffn=gelu", "model.tie_embeddings=false", "train.seq_len=16", "train.global_batch_size=8",
        "train.precision=bf16"]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _cluster(**costs: float) -> Cluster:
    links = {name: LinkCost(0.0, 100e9) for name in COLLECTIVES}
    return Cluster("round", 4, 80 * 2**30, 1e12, {"bf16": 1e12, "fp32": 1e11}, ((1.0, 1.0),),
                   {"intra_node": links, "inter_node": dict(links)}, **costs)


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_config(overrides=TINY))


def test_formulas():
    cluster = _cluster(elementwise_bandwidth_bytes=5e9, loss_seconds_per_logit=2e-9, block_overhead_s=0.9e-3,
                       step_overhead_s=4e-3)
    assert elementwise_forward_seconds(cluster, 10e6) == pytest.approx(10e6 / 5e9)  # A / B_e
    assert loss_forward_seconds(cluster, 2048, 4000) == pytest.approx(2048 * 4000 * 2e-9 / 3)  # t V c / 3
    assert block_dispatch_forward_seconds(cluster) == pytest.approx(0.3e-3) and step_dispatch_seconds(cluster) == 4e-3
    # no calibrated elementwise bandwidth: the memory bandwidth
    assert elementwise_forward_seconds(_cluster(), 10e6) == pytest.approx(10e6 / 1e12)


def test_step_time_adds_each_cost_where_it_belongs(shape):
    layout = Layout(micro_batch=2, microbatches=4)
    blocks = tuple(range(4))
    plain = microbatch_times(shape, _cluster(), layout, blocks, True)
    stored = block_activation_bytes(shape, shape.blocks[0], 2, "none")
    slow = microbatch_times(shape, _cluster(elementwise_bandwidth_bytes=1e9), layout, blocks, True)
    assert slow.blocks - plain.blocks == pytest.approx(4 * stored * (1 / 1e9 - 1 / 1e12))
    dispatch = microbatch_times(shape, _cluster(block_overhead_s=3e-3), layout, blocks, True)
    assert dispatch.blocks - plain.blocks == pytest.approx(4 * 1e-3) and dispatch.head == plain.head
    loss = microbatch_times(shape, _cluster(loss_seconds_per_logit=3e-9), layout, blocks, True)
    assert loss.head - plain.head == pytest.approx(2 * 16 * 64 * 1e-9) and loss.blocks == plain.blocks
    assert microbatch_times(shape, _cluster(loss_seconds_per_logit=3e-9), layout, blocks, False).head == 0.0
    where = placement(layout.apply(shape.config))
    base = step_time(shape, _cluster(), layout, where)
    step = step_time(shape, _cluster(step_overhead_s=5e-3, block_overhead_s=3e-3), layout, where)
    # 4 microbatches x 4 blocks x 3e-3 s, and the step's 5e-3 s once
    assert step.overhead == 5e-3 and step.total - base.total == pytest.approx(4 * 4 * 3e-3 + 5e-3)
    # processes sharing cores: 4 processes on 2 cores pay twice
    shared = dataclasses.replace(_cluster(step_overhead_s=5e-3), concurrent_devices=2)
    assert step_time(shape, shared, Layout(dp=4, micro_batch=2), placement(
        Layout(dp=4, micro_batch=2).apply(shape.config))).overhead == pytest.approx(10e-3)


def test_tensor_parallel_collectives_take_the_calibrated_figures():
    measured = (("all_reduce", LinkCost(500e-6, 1e9)), ("all_gather", LinkCost(1e-3, 0.1e9)),
                ("reduce_scatter", LinkCost(800e-6, 0.4e9)))
    cluster = _cluster(tensor_parallel=measured)
    # 2 ranks: reduce-scatter 1 step of latency, factor 1/2
    assert tensor_parallel_seconds(cluster, "reduce_scatter", 2, 2e6) == pytest.approx(800e-6 + 0.5 * 2e6 / 0.4e9)
    assert tensor_parallel_seconds(cluster, "all_gather", 2, 2e6, calls=3) == pytest.approx(3e-3 + 1e6 / 0.1e9)
    assert collective_seconds(cluster, "all_gather", 2, 2e6) == pytest.approx(1e6 / 100e9)  # others: the link's
    assert tensor_parallel_seconds(_cluster(), "all_gather", 2, 2e6) == collective_seconds(_cluster(), "all_gather",
                                                                                          2, 2e6)
