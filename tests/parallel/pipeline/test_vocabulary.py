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
    WEIGHT_TOLERANCE,
    assert_copies_equal,
    assert_matches_single,
    checkpoint_keys,
    decoder_config,
    encoder_config,
    encoder_decoder_config,
    make_batch,
)

from xscale.config.load import load_config
from xscale.config.schema import ConfigError, TrainConfig
from xscale.models import build_model
from xscale.models.init import canonical_name
from xscale.parallel.model import ParallelModel
from xscale.parallel.pipeline import PipelineSchedule, check_pipeline
from xscale.parallel.pipeline.cost import pipeline_costs, stage_layers
from xscale.parallel.pipeline.vocabulary import (
    VocabularyPlace,
    VocabularyShard,
    every_shard_has_rows,
    vocabulary_rows,
)
from xscale.train.optim import build_optimizer
from xscale.train.step import evaluation_loss, forward_backward_step

VOCAB_LAYOUT = "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,pp_vocab_parallel=true"


def test_vocabulary_rows_are_torch_chunks_split():
    """The rows are the pieces a DTensor sharded on dim 0 holds (torch.chunk's split), so checkpoints can show them as
    one tensor; a split leaving a shard empty is refused."""
    for vocab, shards in [(64, 2), (65, 3), (7, 7), (10, 4)]:
        rows = [vocabulary_rows(vocab, shard, shards) for shard in range(shards)]
        assert [end - start for start, end in rows] == [len(piece) for piece in torch.arange(vocab).chunk(shards)]
        assert rows[0][0] == 0 and rows[-1][1] == vocab
        assert all(end == start for (_, end), (start, _) in zip(rows, rows[1:]))
    assert every_shard_has_rows(10, 4) and not every_shard_has_rows(5, 4)
    with pytest.raises(ConfigError, match="no rows"):
        check_pipeline(vocab_config("model.vocab_size=5", "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b",
                                    "parallel.pp_stages_per_rank=2", "model.n_layers=8"))


@pytest.mark.parametrize("shards, bias", [(2, False), (3, True)])
def test_shard_chain_is_the_cross_entropy_sum(shards, bias):
    """The shards run one after another on one process, each holding its rows of the projection: loss and gradients
    (hidden states, weight, bias) equal the cross-entropy of the whole projection, labels -100 and labels in every
    shard included. Each shard starts from its rows of the single-process initial weights."""
    config = decoder_config(1)
    config.vocab_size, config.lm_head_bias, config.tie_embeddings = 65, bias, False
    model = build_model(config, seed=0)
    with torch.no_grad():
        model.output.bias.normal_() if bias else None
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, config.d_model, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (2, 6))
    labels[0, :2] = -100
    labels[1, 0], labels[1, 1] = 0, config.vocab_size - 1  # the first and last row of the vocabulary
    expected = F.cross_entropy(model.output(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    expected_grads = torch.autograd.grad(expected, [hidden, *model.output.parameters()])

    shard_modules = [VocabularyShard(build_model(config, materialize=False), VocabularyPlace(shard, shards, shard))
                     for shard in range(shards)]
    for module in shard_modules:
        module.to_empty(device="cpu")
        module.reset_parameters(seed=0)
        assert torch.equal(module.output.weight, model.output.weight[module.start:module.end].detach())
        with torch.no_grad():
            for name, param in module.output.named_parameters():
                param.copy_(model.output.get_parameter(name)[module.start:module.end])
    passed: tuple = (hidden,)
    for module in shard_modules:
        passed = module(*passed, labels=labels)
        passed = passed if isinstance(passed, tuple) else (passed,)
    (loss,) = passed
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    names = [name for name, _ in model.output.named_parameters()]
    grads = torch.autograd.grad(loss, [hidden, *[module.output.get_parameter(name) for name in names
                                                 for module in shard_modules]])
    joined = [grads[0]] + [torch.cat(grads[1 + index * shards:1 + (index + 1) * shards]) for index in
                           range(len(names))]
    for got, want in zip(joined, expected_grads):
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


def whole_parameters(engine: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter of the pipeline under its single-process name, the vocabulary stages' rows put together
    (on every rank)."""
    mine = []
    for stage in engine.pipeline.stages:
        start = stage.start if isinstance(stage, VocabularyShard) else None
        mine += [(canonical_name(name), start, param.detach().clone()) for name, param in stage.named_parameters()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    whole, pieces = {}, {}
    for name, start, value in (entry for ranked in everyone for entry in ranked):
        if start is None:
            whole[name] = value
        else:
            pieces.setdefault(name, {})[start] = value
    for name, rows in pieces.items():
        whole[name] = torch.cat([rows[start] for start in sorted(rows)])
    return whole


def train_steps(engine: ParallelModel, optimizer: torch.optim.Optimizer, config, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        forward_backward_step(engine, make_batch(config, seed=step))
        optimizer.step()


def checkpoint_config(tied: bool):
    config = decoder_config(3)
    config.tie_embeddings, config.vocab_size = tied, 63  # 63 rows: 32 + 31
    return config


def resumed(config, folder: str, checkpoint: str, **layout) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """A pipeline of ``layout`` started from other weights, trained a step (optimizer state to overwrite), then
    loaded from ``checkpoint``."""
    pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD, 2,
                                          seed=SEED + 1, **layout)
    engine = ParallelModel(pipeline.stages, micro_batch_size=0, pipeline=pipeline)
    optimizer = build_optimizer(engine.parameters(), torch_train_config())
    train_steps(engine, optimizer, config, range(5, 6))
    state = engine.state_dict(optimizer)
    dcp.load(state, checkpoint_id=f"{folder}/{checkpoint}")
    engine.load_state_dict(state, optimizer)
    return engine, optimizer


def assert_same_run(engine: ParallelModel, optimizer: torch.optim.Optimizer, config, saved: dict,
                    continued: dict, step: int) -> None:
    """``engine`` holds the ``saved`` weights, and its next step gives the ``continued`` ones (to the tolerance of
    another summation order; wrong optimizer moments would move them by ~lr)."""
    for name, value in whole_parameters(engine).items():
        assert torch.equal(value, saved[name]), name
    assert_copies_equal(engine)
    train_steps(engine, optimizer, config, range(step, step + 1))
    for name, value in whole_parameters(engine).items():
        torch.testing.assert_close(value, continued[name], **WEIGHT_TOLERANCE, msg=name)


def check_checkpoint(rank: int, folder: str, tied: bool) -> None:
    """A vocabulary pipeline's checkpoint after 2 steps resumes under ZB-V's vocabulary stages and on a pipeline
    whose last stage holds the whole head; that pipeline's checkpoint resumes on vocabulary stages. Each resumed run
    holds the saved weights and takes the step the saving run took next."""
    config = checkpoint_config(tied)
    vocabulary = {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "vocab_parallel": True}
    pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD, 2,
                                          seed=SEED, **vocabulary)
    engine = ParallelModel(pipeline.stages, micro_batch_size=0, pipeline=pipeline)
    optimizer = build_optimizer(engine.parameters(), torch_train_config())
    train_steps(engine, optimizer, config, range(2))
    assert_copies_equal(engine)
    dcp.save(engine.state_dict(optimizer), checkpoint_id=f"{folder}/pipeline")
    saved = whole_parameters(engine)
    train_steps(engine, optimizer, config, range(2, 3))
    continued = whole_parameters(engine)
    if rank == 0:
        torch.save({"saved": saved, "continued": continued}, f"{folder}/values.pt")

    assert_same_run(*resumed(config, folder, "pipeline", schedule="zero_bubble", stages_per_rank=2,
                             vocab_parallel=True), config, saved, continued, 2)
    whole_head, whole_optimizer = resumed(config, folder, "pipeline", schedule="1f1b")
    assert_same_run(whole_head, whole_optimizer, config, saved, continued, 2)
    dcp.save(whole_head.state_dict(whole_optimizer), checkpoint_id=f"{folder}/whole_head")
    saved = whole_parameters(whole_head)
    train_steps(whole_head, whole_optimizer, config, range(3, 4))
    assert_same_run(*resumed(config, folder, "whole_head", **vocabulary), config, saved,
                    whole_parameters(whole_head), 3)


def torch_train_config() -> TrainConfig:
    return TrainConfig(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_holds_the_projection_once_and_resumes_on_another_layout(tmp_path, tied):
    """The checkpoint has the single-process names and shapes; it resumes on other vocabulary ranks (above) and on
    one process, whose third step equals the pipeline's."""
    spawn(check_checkpoint, str(tmp_path), tied)
    config = checkpoint_config(tied)
    model = build_model(config, seed=SEED + 1)
    optimizer = build_optimizer(model.parameters(), torch_train_config())
    engine = ParallelModel([model], micro_batch_size=4)
    train_steps(engine, optimizer, config, range(5, 6))  # the optimizer state exists, as in the pipeline's checkpoint
    dcp.save(engine.state_dict(optimizer), checkpoint_id=tmp_path / "single")
    assert checkpoint_keys(tmp_path / "pipeline") == checkpoint_keys(tmp_path / "single")
    state = engine.state_dict(optimizer)
    dcp.load(state, checkpoint_id=tmp_path / "pipeline")
    engine.load_state_dict(state, optimizer)
    values = torch.load(tmp_path / "values.pt")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), values["saved"][name]), name
    train_steps(engine, optimizer, config, range(2, 3))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), values["continued"][name], **WEIGHT_TOLERANCE, msg=name)


def test_trainer_matches_one_process(tmp_path):
    assert_parity(DECODER + ["model.tie_embeddings=false"], [VOCAB_LAYOUT], tmp_path, same_grad_norms=True)


def test_trainer_with_tensor_parallelism_matches_one_process(tmp_path):
    """Each vocabulary stage split over tp=2, without and with sequence parallelism; tied embeddings, so the rows'
    gradients meet the vocabulary-parallel embedding's."""
    assert_parity(DECODER, [f"tp=2,{VOCAB_LAYOUT}", f"tp=2,sequence_parallel=true,{VOCAB_LAYOUT}"], tmp_path,
                  same_grad_norms=True)


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
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2", "parallel.tp=4", "model.vocab_size=6"],
     "leave a tp rank none"),
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
    # the stages hold the projection's rows once between them: the whole model's cost, split
    assert sum(stage_costs) == pytest.approx(sum(costs.blocks) + costs.embedding + costs.head)
    whole = pipeline_costs(config).stage_costs(stage_layers(vocab_config("parallel.pp_vocab_parallel=false"), 2))
    assert min(whole) / max(whole) < 0.85
