"""Each rank's peak terms (:mod:`xscale.estimate.memory`) against figures worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from xscale.config.load import load_config
from xscale.estimate.memory import (
    PeakTerms,
    UnitSizes,
    accumulated_backward_bytes,
    activation_share,
    all_gather_bytes,
    expert_exchange_bytes,
    fused_loss_chunk_bytes,
    head_activation_share,
    live_gradient_bytes,
    microbatches_in_flight,
    parameter_gather_bytes,
    pipeline_buffer_bytes,
    pipeline_send_bytes,
    step_temporary_bytes,
    unit_sizes,
    vocab_parallel_loss_bytes,
)
from xscale.models.parameters import count_parameters
from xscale.parallel.data.gather import GATHER_WINDOW_BYTES
from xscale.parallel.dims import ParallelDims

BASE = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=3", "model.n_heads=4", "train.seq_len=16",
        "train.global_batch_size=8"]
SIZES = UnitSizes(root=1000, blocks=[300, 500, 400], largest=640)
ZERO3 = ParallelDims(dp_shard=2, zero_stage=3)


def _config(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def test_peak_is_the_state_plus_the_larger_phase():
    terms = PeakTerms(parameters=100, gradients=100, optimizer=200, activations=50, all_gather=30,
                      step_temporaries=70)
    assert terms.model_state == 400 and terms.peak == 480  # forward/backward: 50 + 30
    assert dataclasses.replace(terms, step_temporaries=90).peak == 490  # the optimizer step


def test_zero12_overlapped_gather_starts_with_its_window_and_ends_with_the_last_block_and_head():
    zero1 = ParallelDims(dp_shard=2, zero_stage=1)
    # the window holds all 2200 parameters: the forward starts with them + kept gradients, and the last block (500)
    # is late in it (tied embeddings)
    assert parameter_gather_bytes(_config(), zero1, SIZES, gradients=123) == (123 + 4 * 2200, 4 * 500)
    untied = _config("model.tie_embeddings=false")  # the head (64 x 32) is reached last too
    assert parameter_gather_bytes(untied, zero1, dataclasses.replace(SIZES, root=5000), 0)[1] == 4 * (500 + 64 * 32)
    assert parameter_gather_bytes(untied, zero1, SIZES, 0)[1] == 4 * 2200  # never more than is gathered at all
    assert parameter_gather_bytes(_config(), ParallelDims(dp_shard=2, tp=2, zero_stage=2), SIZES, 0) == (4400, 1000)
    # a model larger than the window: the window in flight (here at most the last block's late in the forward)
    large = UnitSizes(root=10 * 2**20, blocks=[2**20] * 12, largest=2**20)
    assert parameter_gather_bytes(_config(), zero1, large, 0) == (GATHER_WINDOW_BYTES, 4 * 2**20)
    # a bucket larger than the window (one parameter of 128 MiB): one bucket is always let through
    huge = dataclasses.replace(large, root=2**26, largest=2**25)
    assert parameter_gather_bytes(_config(), zero1, huge, 0)[0] == 4 * 2**25
    for dims, config in ((zero1, _config("parallel.overlap_param_gather=false")), (ParallelDims(dp_shard=2), _config()),
                         (ZERO3, _config()), (ParallelDims(zero_stage=1), _config())):
        assert parameter_gather_bytes(config, dims, SIZES, 123) == (0, 0)  # no gather in flight, or none at all
    terms = PeakTerms(parameters=100, gradients=100, optimizer=200, activations=50, gather_in_forward=20,
                      forward_start=260)
    assert terms.peak == 300 + 260  # the forward's start: more than backward (50 + 100 + 20) or the step (100)
    assert dataclasses.replace(terms, forward_start=0).peak == 300 + 170


def test_all_gather_is_the_root_less_its_shard_plus_two_blocks_twice():
    # fp32: 4 x (1000 x (1 - 1/2) + 2 x (500 + 400)) = 4 x 2300
    assert all_gather_bytes(_config(), ZERO3, SIZES) == 9200
    assert all_gather_bytes(_config("train.precision=bf16"), ZERO3, SIZES) == 4600
    assert all_gather_bytes(_config(), ParallelDims(dp_shard=2, tp=2, zero_stage=3), SIZES) == 4600
    # a pipeline stage keeps all its blocks gathered: 4 x (500 + 2 x 1200)
    assert all_gather_bytes(_config(), ParallelDims(pp=2, dp_shard=2, zero_stage=3), SIZES) == 11600
    for below in (0, 1, 2):  # nothing is gathered without ZeRO-3
        assert all_gather_bytes(_config(), ParallelDims(dp_shard=2, zero_stage=below), SIZES) == 0


def test_step_temporaries_are_three_of_the_largest_local_piece():
    assert step_temporary_bytes(_config(), ParallelDims(), SIZES, 1e6) == 0  # auto: the fused update, none
    config = _config("train.optimizer_foreach=false")  # one parameter at a time
    assert step_temporary_bytes(config, ParallelDims(), SIZES, 1e6) == 3 * 4 * 640
    assert step_temporary_bytes(config, ParallelDims(dp_shard=2, zero_stage=1), SIZES, 1e6) == 3 * 4 * 640 / 2
    assert step_temporary_bytes(config, ParallelDims(dp_shard=2, zero_stage=0), SIZES, 1e6) == 3 * 4 * 640
    assert step_temporary_bytes(config, ParallelDims(tp=2), SIZES, 1e6) == 3 * 4 * 640 / 2
    foreach = _config("train.optimizer_foreach=true")  # a temporary of every local parameter at once
    assert step_temporary_bytes(foreach, ParallelDims(), SIZES, 12345.0) == 12345.0


def test_activation_share_and_microbatches_in_flight():
    config = _config()
    assert activation_share(config, ParallelDims()) == 1
    assert activation_share(_config("parallel.sequence_parallel=true"), ParallelDims(tp=2)) == 0.5
    replicated = 10 / (34 + 5 * 4 * 16 / 32)  # eq. 2: 10 of 34 + 5as/h stay whole without sequence parallelism
    assert activation_share(config, ParallelDims(tp=2)) == pytest.approx(replicated + (1 - replicated) / 2)
    assert activation_share(config, ParallelDims(cp=2)) == 0.5
    one_f_one_b = _config("parallel.microbatches=4")
    assert [microbatches_in_flight(one_f_one_b, 2, rank) for rank in (0, 1)] == [2, 1]
    assert microbatches_in_flight(_config("parallel.microbatches=4", "parallel.pp_schedule=gpipe"), 2, 1) == 4


def test_gtrxl_gates_stay_whole_under_tensor_parallelism_without_sequence_parallelism():
    gated = _config("model.block=gtrxl", "model.norm_placement=pre")
    replicated = (10 + 24) / (34 + 24 + 5 * 4 * 16 / 32)  # two gates of 12 s b h bytes each, kept whole like norms
    assert activation_share(gated, ParallelDims(tp=2)) == pytest.approx(replicated + (1 - replicated) / 2)
    sequence_parallel = _config("model.block=gtrxl", "model.norm_placement=pre", "parallel.sequence_parallel=true")
    assert activation_share(sequence_parallel, ParallelDims(tp=2)) == 0.5  # each rank gates its own tokens


def test_unit_sizes_split_the_model_into_its_root_and_equal_blocks():
    config = _config("model.tie_embeddings=false")
    sizes = unit_sizes(config)
    assert len(sizes.blocks) == 3 and len(set(sizes.blocks)) == 1
    assert sizes.root + sum(sizes.blocks) == count_parameters(config).total
    assert sizes.root == 2 * 64 * 32 + 32  # embedding, head and the final norm's gain
    assert sizes.largest == 32 * 4 * 32  # an FFN matrix (d_ff = 4 d) outgrows the 64-row embedding
    first_stage = unit_sizes(config, [0, 1])
    assert first_stage.blocks == sizes.blocks[:2]


def test_live_gradients_are_all_of_them_in_buckets_else_the_measured_share_plus_the_largest():
    largest = 4 * 640
    # DDP and ZeRO-1 keep every gradient in their buckets, and autograd's largest gradient before it is copied in
    assert live_gradient_bytes(ParallelDims(dp_shard=2, zero_stage=1), 1000.0, 0.25, SIZES) == 1000 + largest
    assert live_gradient_bytes(ParallelDims(dp_shard=2, zero_stage=0), 1000.0, 0.25, SIZES) == 1000 + largest
    # one process, ZeRO-2/3, tp: freed after each step; the fake step's share at its peak
    assert live_gradient_bytes(ParallelDims(), 1000.0, 0.25, SIZES) == 250 + largest
    assert live_gradient_bytes(ParallelDims(dp_shard=2, zero_stage=3), 1000.0, 0.25, SIZES) == 250 + largest
    assert live_gradient_bytes(ParallelDims(tp=2), 1000.0, 0.0, SIZES) == largest / 2
    terms = PeakTerms(parameters=100, gradients=100, optimizer=200, activations=150, live_gradients=20)
    assert terms.peak == 100 + 200 + 150 + 20  # the backward's 170 outweighs the step's 100 + 0


def test_peak_adds_the_layout_buffers_to_the_larger_of_the_backward_peaks():
    terms = PeakTerms(parameters=100, gradients=40, optimizer=200, activations=50, live_gradients=10,
                      vocab_parallel_loss=20, pipeline_buffers=5, accumulated_backward=150)
    assert terms.peak == 300 + 20 + 5 + 150  # the last microbatch's backward (150) outweighs 50 + 10
    assert dataclasses.replace(terms, accumulated_backward=0).peak == 300 + 20 + 5 + 60  # over the step's 40


def test_vocab_parallel_loss_is_three_fp32_logit_shards_plus_one_per_further_microbatch():
    config = _config()  # vocab 64; 32 tokens: a (32, 32) logits shard per tp=2 rank, 4096 bytes in fp32
    assert vocab_parallel_loss_bytes(config, ParallelDims(tp=2), 32) == 3 * 4096
    assert vocab_parallel_loss_bytes(config, ParallelDims(tp=4), 32) == 3 * 2048
    assert vocab_parallel_loss_bytes(config, ParallelDims(tp=2), 32, microbatches=2) == 4 * 4096
    assert vocab_parallel_loss_bytes(_config("train.precision=bf16"), ParallelDims(tp=2), 32) == 3 * 4096 + 2048
    assert vocab_parallel_loss_bytes(config, ParallelDims(), 32) == 0  # one device: the fused, chunked loss


def test_fused_loss_chunk_is_the_logits_of_one_chunk_of_tokens():
    config = _config()
    assert fused_loss_chunk_bytes(config, 32) == 4 * 32 * 64
    assert fused_loss_chunk_bytes(config, 1 << 20) == 4 * (1 << 25)  # capped at 2^25 logits a chunk


def test_head_share_swaps_the_fused_loss_chunk_for_tp_and_keeps_the_rest_whole():
    config = _config()  # the chunk of 32 tokens: 8192 bytes
    assert head_activation_share(config, ParallelDims(), 10000.0, 32) == 10000
    assert head_activation_share(config, ParallelDims(tp=2), 10000.0, 32) == 10000 - 8192  # replicated
    sequence_parallel = _config("parallel.sequence_parallel=true")
    assert head_activation_share(sequence_parallel, ParallelDims(tp=2), 10000.0, 32) == (10000 - 8192) / 2
    assert head_activation_share(config, ParallelDims(tp=2), 5000.0, 32) == 0  # never negative


def test_pipeline_buffers_are_a_received_hidden_state_and_gradient_per_microbatch():
    config = _config("parallel.microbatches=4")  # d 32, 32 tokens: 4096 bytes of fp32 hidden states a microbatch
    pp2 = ParallelDims(pp=2, microbatches=4)
    assert pipeline_buffer_bytes(config, pp2, 32, [0]) == 4 * 4096  # the first stage: gradients it receives
    assert pipeline_buffer_bytes(config, pp2, 32, [1]) == 4 * 4096  # the last: hidden states it receives
    assert pipeline_buffer_bytes(config, ParallelDims(pp=3, microbatches=4), 32, [1]) == 2 * 4 * 4096
    interleaved = _config("parallel.microbatches=4", "parallel.pp_stages_per_rank=2")
    assert pipeline_buffer_bytes(interleaved, pp2, 32, [0, 2]) == 3 * 4 * 4096  # stages 0 and 2 of 0..3
    sequence_parallel = _config("parallel.microbatches=4", "parallel.sequence_parallel=true")
    assert pipeline_buffer_bytes(sequence_parallel, ParallelDims(pp=2, tp=2, microbatches=4), 32, [1]) == 4 * 2048
    assert pipeline_buffer_bytes(config, ParallelDims(), 32, [0]) == 0


def test_pipeline_sends_are_the_outputs_kept_and_the_gradients_not_yet_waited_for():
    hidden = 4096  # d 32, 32 tokens, fp32
    one_f_one_b = _config("parallel.microbatches=8")
    pp4 = ParallelDims(pp=4, microbatches=8)
    assert pipeline_send_bytes(one_f_one_b, pp4, 32, [0]) == 4 * hidden  # 4 outputs in flight, no gradient sent
    assert pipeline_send_bytes(one_f_one_b, pp4, 32, [1]) == (3 + 1) * hidden  # 3 outputs in flight, one gradient
    assert pipeline_send_bytes(one_f_one_b, pp4, 32, [3]) == 1 * hidden  # the last stage sends only its gradient
    gpipe = _config("parallel.microbatches=8", "parallel.pp_schedule=gpipe")
    assert pipeline_send_bytes(gpipe, pp4, 32, [1]) == (8 + 8) * hidden  # every send waited for at the step's end
    zbv = _config("parallel.microbatches=8", "parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2")
    pp2 = ParallelDims(pp=2, microbatches=8)
    assert pipeline_send_bytes(zbv, pp2, 32, [0, 3]) == (8 + 8) * hidden  # stage 0's outputs, stage 3's gradients
    assert pipeline_send_bytes(zbv, pp2, 32, [1, 2]) == 4 * 8 * hidden
    sequence_parallel = _config("parallel.microbatches=8", "parallel.sequence_parallel=true")
    assert pipeline_send_bytes(sequence_parallel, ParallelDims(pp=4, tp=2, microbatches=8), 32, [3]) == hidden / 2
    assert pipeline_send_bytes(one_f_one_b, ParallelDims(), 32, [0]) == 0


def test_expert_exchange_is_one_buffer_of_routed_tokens_per_direction():
    switch = _config("model.moe.num_experts=4", "model.moe.top_k=1", "model.moe.capacity_factor=1.25")
    routed = 32 * 1 * 1.25  # tokens x k x capacity factor
    assert expert_exchange_bytes(switch, ParallelDims(dp_shard=2, ep=2), 32, 2) == 2 * routed * 32 * 4
    top2 = _config("model.moe.num_experts=4", "model.moe.router=gshard", "model.moe.top_k=2", "model.moe.capacity_factor=1.25")
    assert expert_exchange_bytes(top2, ParallelDims(dp_shard=2, ep=2), 32, 1) == 2 * 2 * routed * 32 * 4
    assert expert_exchange_bytes(switch, ParallelDims(dp_shard=2), 32, 2) == 0  # no ep: no exchange
    assert expert_exchange_bytes(switch, ParallelDims(dp_shard=2, ep=2), 32, 0) == 0  # no MoE layer on this rank
    terms = PeakTerms(parameters=100, gradients=40, optimizer=200, activations=50, expert_exchange=7)
    assert terms.peak == 300 + 7 + 50 + 40


def test_accumulated_backward_is_the_microbatches_in_flight_with_every_gradient():
    # 1F1B's last stage, 2 microbatches: one in flight (100), the head's transient (30), all gradients, the largest
    assert accumulated_backward_bytes(2, 1, held=100.0, transient=30.0, gradients=50.0, largest=8.0) == 188
    # the first stage of 2, 4 microbatches: 2 in flight in the steady state; GPipe's 4 in flight: 3 at the 2nd backward
    assert accumulated_backward_bytes(4, 2, held=100.0, transient=0.0, gradients=50.0, largest=8.0) == 258
    assert accumulated_backward_bytes(4, 4, held=100.0, transient=0.0, gradients=50.0, largest=8.0) == 358
    assert accumulated_backward_bytes(1, 1, held=100.0, transient=30.0, gradients=50.0, largest=8.0) == 0
