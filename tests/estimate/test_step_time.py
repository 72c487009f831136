"""The step-time model's terms (:mod:`xscale.estimate.step_time`, :mod:`xscale.estimate.communication`) against
hand computations on a cluster of round figures (efficiency 1, no latency unless a test sets one)."""

from __future__ import annotations

import dataclasses

import pytest

from xscale.config.load import load_config
from xscale.estimate.activations import block_activation_bytes
from xscale.estimate.cluster import Cluster, LinkCost
from xscale.estimate.communication import bandwidth_factor, collective_seconds, latency_steps, spans_nodes
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import Placement, dense_parameters_per_tp_rank, placement, rank_parameters
from xscale.estimate.step_time import bubble_seconds, microbatch_times, shared_bubble_seconds, step_time

TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.d_ff=64",
        "model.ffn=gelu", "model.tie_embeddings=false", "train.seq_len=16", "train.global_batch_size=8",
        "train.precision=bf16"]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _cluster(latency_s: float = 0.0) -> Cluster:
    intra = {name: LinkCost(latency_s, 100e9) for name in COLLECTIVES}
    inter = {name: LinkCost(latency_s, 10e9) for name in COLLECTIVES}
    return Cluster("round", 4, 80 * 2**30, 1e12, {"bf16": 1e12, "fp32": 1e11}, ((1.0, 1.0),),
                   {"intra_node": intra, "inter_node": inter})


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_config(overrides=TINY))


def test_alpha_beta_formulas():
    assert [latency_steps(name, 8) for name in COLLECTIVES] == [6, 3, 3, 7, 1]
    assert bandwidth_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bandwidth_factor("all_gather", 4) == pytest.approx(0.75) and bandwidth_factor("send_recv", 2) == 1
    assert spans_nodes(4, 1, 4) is False and spans_nodes(2, 4, 4) is True
    cluster = _cluster(latency_s=1e-6)
    # all-reduce of 1 GB over 4 ranks of one node: 4 steps x 1 us + 1.5 x 1e9 / 100e9 s
    assert collective_seconds(cluster, "all_reduce", 4, 1e9) == pytest.approx(4e-6 + 0.015)
    # the same ranks 4 apart cross nodes: the inter-node bandwidth; 3 calls pay the latency 3 times
    assert collective_seconds(cluster, "all_reduce", 4, 1e9, stride=4, calls=3) == pytest.approx(12e-6 + 0.15)
    assert collective_seconds(cluster, "all_gather", 1, 1e9) == 0.0


def test_block_flops_and_compute_time(shape):
    model = shape.model
    block = shape.blocks[0]
    # attention 4 d^2 + FFN 2 d f weights (no biases, norms 2 d), causal keys T / 2
    assert block.used == 4 * 32 * 32 + 2 * 32 * 64 + 2 * 32
    assert block.keys == 8
    assert block.forward_flops_per_token(32) == 2 * block.used + 4 * 8 * 32
    layout = Layout(micro_batch=2, microbatches=4)
    times = microbatch_times(shape, _cluster(), layout, tuple(range(4)), True)
    tokens = 2 * 16
    gemm = 2 * tokens * block.used / 1e12
    attention = 4 * tokens * 8 * 32 / 1e12
    elementwise = block_activation_bytes(shape, block, 2, "none") / 1e12  # written once in the forward
    assert times.attention == pytest.approx(4 * attention)
    assert times.blocks == pytest.approx(4 * (gemm + attention + elementwise))
    assert times.head == pytest.approx(2 * tokens * (64 * 32 + shape.outside) / 1e12)
    assert model.n_layers == 4
    # a calibrated attention grid (head dim 8, keys 8 here) prices the attention core alone: at 25% of the peak
    # it takes 4x as long, the GEMMs and the head unchanged
    grid = ((4.0, 4.0, 0.25), (4.0, 16.0, 0.25), (16.0, 4.0, 0.25), (16.0, 16.0, 0.25))
    slow = microbatch_times(shape, dataclasses.replace(_cluster(), attention_efficiency=grid), layout,
                            tuple(range(4)), True)
    assert slow.attention == pytest.approx(4 * times.attention)
    assert slow.blocks - slow.attention == pytest.approx(times.blocks - times.attention)
    assert slow.head == pytest.approx(times.head)


def test_activation_bytes_by_hand(shape):
    block = shape.blocks[0]
    s, b, h, f = 16, 2, 32, 64
    assert block_activation_bytes(shape, block, b, "none") == s * b * (18 * h + 4 * f)  # Korthikanti eq. 1, 16-bit
    assert block_activation_bytes(shape, block, b, "full") == 2 * s * b * h


def test_bubble_per_schedule(shape):
    times = microbatch_times(shape, _cluster(), Layout(pp=4, micro_batch=1, microbatches=8), (0,), False)
    one = 3 * times.forward()
    assert bubble_seconds(Layout(pp=4, schedule="1f1b"), times) == pytest.approx(3 * one)
    assert bubble_seconds(Layout(pp=4, schedule="gpipe"), times) == pytest.approx(3 * one)
    assert bubble_seconds(Layout(pp=4, schedule="interleaved_1f1b", stages_per_rank=2), times) == \
        pytest.approx(1.5 * one)
    assert bubble_seconds(Layout(pp=4, schedule="zero_bubble", stages_per_rank=2), times) == 0.0
    full = Layout(pp=4, schedule="zero_bubble", stages_per_rank=2, checkpointing="full")
    assert bubble_seconds(full, times) == pytest.approx(3 * times.blocks / 2)
    # the bubble is (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021)
    assert 3 * one / (8 * one + 3 * one) == pytest.approx((4 - 1) / (8 + 4 - 1))


def test_tensor_parallel_and_optimizer_terms(shape):
    layout = Layout(tp=2, dp=4, micro_batch=2, microbatches=1)
    where = placement(layout.apply(shape.config))
    step = step_time(shape, _cluster(), layout, where)
    # 4 blocks x (2 forward + 2 backward) all-reduces of t d bf16 over 2 ranks in one node (factor 1), the
    # vocabulary-parallel embedding's output forward and backward, the loss's 3 fp32 values per token
    size = 2 * 16 * 32 * 2
    assert step.communication["tp"] == pytest.approx((4 * 4 * size + 2 * size + 3 * 2 * 16 * 4) / 100e9)
    # sequence parallelism: a reduce-scatter and an all-gather (factor 1/2 each) per all-reduce, and 2 norm weight
    # gradients (d fp32) per block all-reduced in the backward
    sp = step_time(shape, _cluster(), dataclasses.replace(layout, sequence_parallel=True), where)
    assert sp.communication["tp"] == pytest.approx((4 * 4 * size + size + 8 * 32 * 4 + 3 * 2 * 16 * 4) / 100e9)
    # DDP's optimizer: 28 bytes per parameter a tp rank holds (half the split ones, every norm and row-parallel
    # bias: tests/estimate/test_tensor_parallel_state.py), over 1e12 B/s
    held = dense_parameters_per_tp_rank(rank_parameters(shape, where, 0, tp=2), 2)
    assert shape.total_parameters / 2 < held < shape.total_parameters
    assert step.optimizer == pytest.approx(28 * held / 1e12)
    zero = step_time(shape, _cluster(), dataclasses.replace(layout, zero_stage=1), where)
    assert zero.optimizer == pytest.approx(step.optimizer / 4)
    assert step.total == pytest.approx(step.compute + step.bubble + step.exposed_communication + step.optimizer)


def test_data_parallel_overlap(shape):
    """DDP's all-reduce hides behind the last microbatch's backward; what is longer is exposed."""
    layout = Layout(dp=8, micro_batch=1, microbatches=1)
    where = Placement((tuple(range(4)),), 0, 0)
    slow = _cluster()
    slow.links["inter_node"]["all_reduce"] = LinkCost(0.0, 1e3)  # 1 kB/s: nothing can hide it
    step = step_time(shape, slow, layout, where)
    size = 4 * shape.total_parameters
    reduce = 2 * 7 / 8 * size / 1e3
    times = microbatch_times(shape, slow, layout, tuple(range(4)), True)
    assert step.communication["dp"] == pytest.approx(reduce - 2 * times.forward())
    fast = step_time(shape, _cluster(), layout, where)
    # fast links: exposed is the last bucket, here all of it (the model's gradients fit one 4 MiB bucket)
    assert fast.communication["dp"] == pytest.approx(2 * 7 / 8 * size / 10e9)



def test_shared_cores_slow_compute_and_stop_overlap(shape):
    """Processes beyond a CPU node's cores share them (compute_share); gloo's threads then take turns with the
    compute, so the dp collectives are exposed whole."""
    where = Placement((tuple(range(4)),), 0, 0)
    cpu = dataclasses.replace(_cluster(), device="cpu", concurrent_devices=2)
    alone = microbatch_times(shape, cpu, Layout(dp=2), tuple(range(4)), True)
    shared = microbatch_times(shape, cpu, Layout(dp=4), tuple(range(4)), True)
    assert shared.blocks == pytest.approx(2 * alone.blocks) and shared.head == pytest.approx(2 * alone.head)
    layout = Layout(dp=2, micro_batch=1, microbatches=1)
    size = 4 * shape.total_parameters
    step = step_time(shape, cpu, layout, where)
    assert step.communication["dp"] == pytest.approx(2 * 1 / 2 * size / 100e9)  # all of it, none hidden
    gpu = step_time(shape, dataclasses.replace(_cluster(), concurrent_devices=2), layout, where)
    assert gpu.communication["dp"] == step.communication["dp"]  # one bucket either way at these sizes
    # a slow all-reduce in small buckets: all but the last bucket hidden behind the backward on GPUs, whole on the
    # CPU node
    shape = model_shape(load_config(overrides=[*TINY, "parallel.bucket_mb=0.001"]))
    slow_links = {**cpu.links, "inter_node": {**cpu.links["inter_node"], "all_reduce": LinkCost(0.0, 5e9)}}
    wide = Layout(dp=8, micro_batch=1, microbatches=1)
    reduce = 2 * 7 / 8 * size / 5e9
    times = microbatch_times(shape, dataclasses.replace(cpu, links=slow_links), wide, tuple(range(4)), True)
    on_cpu = step_time(shape, dataclasses.replace(cpu, links=slow_links), wide, where)
    on_gpu = step_time(shape, dataclasses.replace(cpu, links=slow_links, device="gpu"), wide, where)
    assert on_cpu.communication["dp"] == pytest.approx(reduce)
    assert on_cpu.communication["dp"] - on_gpu.communication["dp"] == pytest.approx(2 * times.forward(), rel=1e-3)
    assert reduce > 4 * times.forward() > 1e-3 * reduce  # the difference is not lost in the tolerance


def test_bubbles_lend_their_cores_when_processes_share_them(shape):
    assert shared_bubble_seconds(0.4, 0.2, 1.0) == pytest.approx(0.2)  # a core each: the whole bubble
    # 4 processes on 2 cores (s = 1/2): 0.4 s of compute at the shared rate is 0.2 s at full rate; with 0.1 s of
    # full-rate bubble the rank's path is 0.3 s < 0.4 s of the node's work over its cores: no bubble left
    assert shared_bubble_seconds(0.4, 0.2, 0.5) == 0.0
    assert shared_bubble_seconds(0.4, 0.6, 0.5) == pytest.approx(0.1)  # 0.5 s path > 0.4 s
    layout = Layout(pp=2, dp=2, micro_batch=2, microbatches=2)
    where = placement(layout.apply(shape.config))
    alone = step_time(shape, _cluster(), layout, where)
    shared = step_time(shape, dataclasses.replace(_cluster(), concurrent_devices=2), layout, where)
    assert shared.compute == pytest.approx(2 * alone.compute)
    assert shared.bubble == pytest.approx(shared_bubble_seconds(shared.compute, 2 * alone.bubble, 0.5))
