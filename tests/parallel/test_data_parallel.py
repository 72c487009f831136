"""Data parallel, ZeRO-1/2/3 and HSDP: 10-step loss parity with one process, and per-rank memory vs ZeRO's formulas."""

from __future__ import annotations

import pytest
from parity_models import DECODER, DROPOUT, ENCODER, assert_parity

from xscale.commands.parity import run_local
from xscale.config.load import load_config
from xscale.estimate.memory import predicted_pipeline_state_bytes, predicted_state_bytes
from xscale.parallel.checks import resolve_dims
from xscale.parallel.dims import rank_coordinates


def test_decoder_dp_and_zero_stages_match_one_process(tmp_path):
    """ZeRO-2 with ~1 KiB buckets: a bucket per parameter, each forward module waiting for its own all-gather."""
    assert_parity(DECODER, ["dp_shard=2", "dp_shard=2,zero_stage=1", "dp_shard=2,zero_stage=2,bucket_mb=0.001",
                            "dp_shard=2,zero_stage=3", "dp_shard=2,zero_stage=3,activation_checkpointing=full"],
                  tmp_path)


def test_encoder_mlm_dp_and_zero_stages_match_one_process(tmp_path):
    assert_parity(ENCODER, ["dp_replicate=2,dp_shard=1", "dp_shard=2,zero_stage=2",
                            "dp_shard=2,zero_stage=3,activation_checkpointing=selective"], tmp_path)


def test_adaptive_span_penalty_counts_once_per_step_over_data_parallel_replicas(tmp_path):
    """Each of a step's forwards (2 microbatches on each of 2 replicas) carries a quarter of the penalty, as each of
    the single process's 4 microbatches does; the gradient norms show a penalty counted per forward."""
    adaptive_span = ["model.attention.kind=adaptive_span", "model.n_kv_heads=4", "train.micro_batch_size=2",
                     "model.attention.options={max_span: 16, ramp: 4, span_loss: 0.05}"]
    assert_parity(DECODER + adaptive_span, ["dp_shard=2"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_dropout_masks_follow_global_samples_under_every_zero_stage(tmp_path):
    """The default tier's check is in test_layouts.py (ZeRO-3 with activation checkpointing)."""
    assert_parity(DECODER + DROPOUT, ["dp_replicate=2,dp_shard=1", "dp_shard=2,zero_stage=1",
                                      "dp_shard=2,zero_stage=2,activation_checkpointing=selective"], tmp_path)


@pytest.mark.slow
def test_hsdp_and_four_rank_zero_match_one_process(tmp_path):
    assert_parity(DECODER, ["dp_replicate=2,dp_shard=2,zero_stage=3", "dp_replicate=2,dp_shard=2,zero_stage=1",
                            "dp_shard=4,zero_stage=2", "dp_shard=4,zero_stage=3"], tmp_path)


# ---------------------------------------------------------------------------------------------------- memory

MEMORY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.ffn=gelu",
          "model.position=learned", "model.max_seq_len=16", "train.global_batch_size=4", "train.seq_len=16",
          "train.progress=false", "train.tensorboard=false", "train.plot=false", "data.dataset=copy",
          "data.num_samples=64", "data.eval_fraction=0.0"]


def _measure(config):
    from xscale.estimate.memory import measured_state_bytes
    from xscale.train.step import forward_backward_step
    from xscale.train.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()  # creates the optimizer state
    forward_backward_step(trainer.model, trainer.next_batch())  # gradients of the next step, before its optimizer step
    return {"measured": measured_state_bytes(trainer.model, trainer.optimizer), "params": trainer.num_params,
            "norm_without_collective": trainer.model.data_parallel.gradients_whole_on_every_rank}


def _check_memory(world_size, stage, tmp_path, layout=()):
    config = load_config(None, [*MEMORY, *layout, f"parallel.zero_stage={stage}", f"train.output_dir={tmp_path}"]
                         + ([] if layout else [f"parallel.dp_shard={world_size}"]))
    ranks = run_local(_measure, world_size, config)
    dims = resolve_dims(config, world_size)
    if dims.pp > 1:
        per_stage = predicted_pipeline_state_bytes(config, dims)
        predicted = [per_stage[rank_coordinates(dims, rank)["pp"]] for rank in range(world_size)]
    else:
        predicted = [predicted_state_bytes(ranks[0]["params"], dims)] * world_size
    for rank, result in enumerate(ranks):
        # Only DDP (every gradient whole and equal on every rank) takes its global gradient norm locally.
        assert result["norm_without_collective"] == (stage == 0 and dims.pp == 1 and dims.tp == 1)
        for kind, expected in predicted[rank].items():
            measured = result["measured"][kind]
            assert abs(measured - expected) <= 0.03 * expected, \
                f"ZeRO-{stage} at {world_size}, rank {rank}: {kind} {measured} bytes vs formula {expected:.0f}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_state_bytes_follow_zero_formulas_at_two_ranks(stage, tmp_path):
    _check_memory(2, stage, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_rank_state_bytes_follow_zero_formulas_at_four_ranks(stage, tmp_path):
    _check_memory(4, stage, tmp_path)


@pytest.mark.slow
def test_pipeline_zero3_state_bytes_follow_the_formulas_per_stage(tmp_path):
    _check_memory(4, 3, tmp_path, layout=["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"])
