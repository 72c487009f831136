"""Vocabulary parallelism over the pipeline (parallel.pp_vocab_parallel): the chain of vocabulary shards gives the
single-process cross-entropy and gradients, alone and as the last pp stages of every schedule that can hold them,
through the trainer, in checkpoints that resume on one process, and in the cost model's split."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity_models import DECODER, ENCODER, assert_parity
from spawned import spawn
from test_pipeline import (
    LOSS_TOLERANCE,
    SEED,
    assert_copies_equal,
    assert_matches_single,
    checkpoint_keys,
    decoder_config,
    encoder_config,
    encoder_decoder_config,
    make_batch,
)

from xscale.config import ConfigError, TrainConfig
from xscale.models import build_model
from xscale.models.init import canonical_name
from xscale.parallel.model import ParallelModel
from xscale.parallel.pipeline import PipelineSchedule, check_pipeline
from xscale.parallel.pipeline.cost import pipeline_costs, stage_layers
from xscale.parallel.pipeline.vocabulary import VocabularyShard, vocabulary_rows
from xscale.train.optim import build_optimizer
from xscale.train.step import evaluation_loss, forward_backward_step
from xscale.validate import load_config

VOCAB_LAYOUT = "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,pp_vocab_parallel=true"


def test_vocabulary_rows_cover_the_vocabulary_once():
    for vocab, shards in [(64, 2), (65, 3), (7, 7), (10, 4)]:
        rows = [vocabulary_rows(vocab, shard, shards) for shard in range(shards)]
        assert rows[0][0] == 0 and rows[-1][1] == vocab
        assert all(end == start for (_, end), (start, _) in zip(rows, rows[1:]))
        sizes = [end - start for start, end in rows]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("shards, bias", [(2, False), (3, True)])
def test_shard_chain_is_the_cross_entropy_sum(shards, bias):
    """The shards run one after another on one process: loss and gradients (hidden states, weight, bias) equal
    the cross-entropy of the whole projection, labels -100 and labels in every shard included."""
    config = decoder_config(1)
    config.vocab_size, config.lm_head_bias, config.tie_embeddings = 65, bias, False
    torch.manual_seed(0)
    model = build_model(config, seed=0)
    hidden = torch.randn(2, 6, config.d_model, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (2, 6))
    labels[0, :2] = -100
    labels[1, 0], labels[1, 1] = 0, config.vocab_size - 1  # the first and last row of the vocabulary
    expected = F.cross_entropy(model.output(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    expected_grads = torch.autograd.grad(expected, [hidden, *model.output.parameters()])

    passed: tuple = (hidden,)
    for shard in range(shards):
        passed = VocabularyShard(model, shard, shards)(*passed, labels=labels)
        passed = passed if isinstance(passed, tuple) else (passed,)
    (loss,) = passed
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    grads = torch.autograd.grad(loss, [hidden, *model.output.parameters()])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def check_engine(rank: int) -> None:
    """Every parameter and gradient equals the single-process model's after two accumulated steps; copies of the
    projection stay equal; evaluation too. Untied and tied decoders (tied: the embedding and the vocabulary
    stages' copies are one shared parameter), an MLM encoder with a biased head and an encoder-decoder."""
    untied = decoder_config(3)
    untied.tie_embeddings = False
    cases = [(untied, "interleaved_1f1b", 4), (decoder_config(3), "interleaved_1f1b", 4),
             (untied, "zero_bubble", 4), (decoder_config(3), "zero_bubble", 2),
             (encoder_config(3), "interleaved_1f1b", 2), (encoder_decoder_config(2, 2), "zero_bubble", 2)]
    for config, schedule, microbatches in cases:
        batch = make_batch(config)
        single = build_model(config, seed=SEED)
        reference = ParallelModel([single], micro_batch_size=4)
        expected = forward_backward_step(reference, batch)
        pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD,
                                              microbatches, schedule, 2, seed=SEED, vocab_parallel=True)
        assert isinstance(pipeline.stages[-1], VocabularyShard)
        assert pipeline.stages[0].output is None  # the block stages leave the projection to the shards
        engine = ParallelModel(pipeline.stages, micro_batch_size=0, pipeline=pipeline)
        what = f"{config.family} (tied={config.tie_embeddings}) under {schedule}"
        torch.testing.assert_close(forward_backward_step(engine, batch), expected, **LOSS_TOLERANCE, msg=what)
        forward_backward_step(reference, batch)
        forward_backward_step(engine, batch)
        assert_matches_single(engine, single)
        assert_copies_equal(engine)
        torch.testing.assert_close(evaluation_loss(engine, batch), evaluation_loss(reference, batch),
                                   **LOSS_TOLERANCE, msg=what)


def test_vocabulary_stages_match_single_process():
    spawn(check_engine)


def check_checkpoint(rank: int, folder: str) -> None:
    config = decoder_config(3)
    config.tie_embeddings = False
    pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD, 2,
                                          "interleaved_1f1b", 2, seed=SEED, vocab_parallel=True)
    engine = ParallelModel(pipeline.stages, micro_batch_size=0, pipeline=pipeline)
    optimizer = build_optimizer(engine.parameters(), torch_train_config())
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        forward_backward_step(engine, make_batch(config, seed=step))
        optimizer.step()
    assert_copies_equal(engine)
    dcp.save(engine.state_dict(optimizer), checkpoint_id=f"{folder}/pipeline")
    values = {canonical_name(name): param.detach().clone()
              for stage in pipeline.stages for name, param in stage.named_parameters()}
    torch.save(values, f"{folder}/rank{rank}.pt")

    # Resume into a fresh vocabulary-parallel pipeline (other initial weights): every copy takes the saved values.
    fresh_pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD, 2,
                                                "zero_bubble", 2, seed=SEED + 1, vocab_parallel=True)
    fresh = ParallelModel(fresh_pipeline.stages, micro_batch_size=0, pipeline=fresh_pipeline)
    fresh_optimizer = build_optimizer(fresh.parameters(), torch_train_config())
    state = fresh.state_dict(fresh_optimizer)
    dcp.load(state, checkpoint_id=f"{folder}/pipeline")
    fresh.load_state_dict(state, fresh_optimizer)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    saved = {name: value for ranked in everyone for name, value in ranked.items()}
    for stage in fresh_pipeline.stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param.detach(), saved[canonical_name(name)]), name


def torch_train_config() -> TrainConfig:
    return TrainConfig(lr=1e-2, weight_decay=0.1)


def test_checkpoint_holds_the_projection_once_and_resumes_on_one_process(tmp_path):
    spawn(check_checkpoint, str(tmp_path))
    config = decoder_config(3)
    config.tie_embeddings = False
    model = build_model(config, seed=SEED + 1)
    optimizer = build_optimizer(model.parameters(), torch_train_config())
    engine = ParallelModel([model], micro_batch_size=4)
    forward_backward_step(engine, make_batch(config))
    optimizer.step()  # the optimizer state exists, as in the pipeline's checkpoint
    dcp.save(engine.state_dict(optimizer), checkpoint_id=tmp_path / "single")
    assert checkpoint_keys(tmp_path / "pipeline") == checkpoint_keys(tmp_path / "single")
    state = engine.state_dict(optimizer)
    dcp.load(state, checkpoint_id=tmp_path / "pipeline")
    engine.load_state_dict(state, optimizer)
    saved = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name, param in model.named_parameters():
        holders = [values[name] for values in saved if name in values]
        assert holders, f"{name} is in no stage"
        for held in holders:  # both ranks hold output.weight: equal copies
            assert torch.equal(param.detach(), held), name


def test_trainer_matches_one_process(tmp_path):
    assert_parity(DECODER + ["model.tie_embeddings=false"], [VOCAB_LAYOUT], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_trainer_with_data_parallel_and_zero_bubble(tmp_path):
    """Tied embeddings under ZeRO-3 (the copies sharded over dp), ZeRO-1, and zero bubble's split backward."""
    assert_parity(ENCODER, [
        "pp=2,dp_shard=2,zero_stage=3,microbatches=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,"
        "pp_vocab_parallel=true",
        "pp=2,dp_shard=2,zero_stage=1,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,"
        "pp_vocab_parallel=true"], tmp_path, same_grad_norms=True)


def vocab_config(*overrides: str):
    return load_config(None, ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.vocab_size=4000",
                              "parallel.pp=2", "parallel.pp_vocab_parallel=true", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp_schedule=1f1b"], "2 or more stages per rank"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2", "parallel.tp=2"],
     "tensor parallelism"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2", "parallel.pp_split=[1,2,1]"],
     "pp_split"),
])
def test_settings_it_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_pipeline(vocab_config(*overrides))


def test_cost_model_balances_the_blocks_without_the_head():
    """Four blocks and a head worth more than one: a whole-block split leaves one stage 1.3x+ the other; with the
    projection split over the vocabulary stages each rank's cost is within a few percent of the other's."""
    config = vocab_config("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2")
    layers = stage_layers(config, 4)
    assert [len(held) for held in layers] == [2, 2, 0, 0]
    costs = pipeline_costs(config)
    stage_costs = costs.stage_costs(layers, vocabulary_stages=2)
    ranks = [stage_costs[0] + stage_costs[2], stage_costs[1] + stage_costs[3]]
    assert min(ranks) / max(ranks) > 0.95
    assert sum(stage_costs) == pytest.approx(sum(costs.blocks) + costs.embedding + costs.head
                                             + costs.projection_parameters)  # the second copy's update
    whole = pipeline_costs(config).stage_costs(stage_layers(vocab_config("parallel.pp_vocab_parallel=false"), 2))
    assert min(whole) / max(whole) < 0.85
