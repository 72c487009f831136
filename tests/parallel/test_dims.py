"""Layout validation: every impossible layout is refused before a process group exists, saying what to change."""

from __future__ import annotations

import pytest

from xscale.commands.inspect import main as inspect_main
from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.estimate.memory import (
    pipeline_rank_parameters,
    predicted_pipeline_state_bytes,
    predicted_state_bytes,
)
from xscale.parallel.checks import resolve_dims
from xscale.parallel.dims import rank_coordinates

BASE = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "train.global_batch_size=8",
        "train.seq_len=16", "data.dataset=copy"]
MOE = ["model.moe.num_experts=4", "model.moe.router=switch"]

REFUSED = [
    (["parallel.tp=2", "parallel.dp_shard=2"], 2, "4 processes but 2 were launched"),
    (["parallel.tp=3"], 4, "not divisible by pp x dp_replicate x cp x tp"),
    (["parallel.tp=3", "parallel.dp_shard=1"], 3, "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["parallel.tp=2", "parallel.dp_shard=1", "model.vocab_size=65"], 2, "model.vocab_size=65 is not divisible"),
    (["parallel.tp=2", "parallel.dp_shard=1", "model.d_ff=33"], 2, "FFN hidden width 33"),
    (["parallel.ep=2"], 2, "needs an MoE model"),
    ([*MOE, "parallel.ep=4", "parallel.dp_shard=2", "parallel.tp=2"], 4, "must divide the sharded data-parallel"),
    (["parallel.sequence_parallel=true"], 2, "needs parallel.tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "train.seq_len=15"], 2, "a multiple of 2"),
    (["train.global_batch_size=6"], 4, "does not split over 4 data-parallel ranks"),
    (["train.micro_batch_size=3"], 2, "must divide the per-rank batch 4"),
    (["parallel.pp=8", "parallel.dp_shard=1"], 8, "model.n_layers=4 cannot fill 8 pipeline stages"),
    (["parallel.pp=2", "parallel.dp_shard=1", "parallel.microbatches=3"], 2, "does not split into parallel.microbatches=3"),
    (["parallel.zero_stage=4"], 2, "must be 0 (DDP)"),
    (["parallel.cp=3"], 4, "not divisible by pp x dp_replicate x cp x tp = 1 x 1 x 3 x 1 = 3"),
    (["parallel.dp_shard=0"], 2, "dp_shard must be >= 1"),
    (["parallel.tp=0"], 2, "parallel.tp must be >= 1"),
    (["parallel.backend=nccl"], 2, "needs CUDA"),
]


@pytest.mark.parametrize("overrides,world_size,message", REFUSED, ids=[r[2] for r in REFUSED])
def test_impossible_layouts_are_refused(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_dims(load_config(None, [*BASE, *overrides]), world_size)  # degrees < 1 are refused while loading


def test_trainer_refuses_before_any_process_group(monkeypatch, tmp_path):
    import torch.distributed as dist

    from xscale.train.trainer import Trainer

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(None, [*BASE, "parallel.tp=2", "parallel.dp_shard=2", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="launched"):
        Trainer(config)  # a process group would wait for rank 1 forever; validation must come first
    assert not dist.is_initialized()


def test_dp_shard_fills_the_world_and_mesh_coordinates_are_row_major():
    config = load_config(None, [*BASE, *MOE, "parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
                                "train.global_batch_size=8", "parallel.microbatches=2"])
    dims = resolve_dims(config, 16)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.ep, dims.dp, dims.edp) == (2, 4, 2, 2, 4, 2)
    assert rank_coordinates(dims, 0) == {"pp": 0, "dp_replicate": 0, "dp_expert": 0, "ep": 0, "cp": 0, "tp": 0,
                                         "dp_shard": 0, "dp": 0}
    last = rank_coordinates(dims, 15)
    assert (last["pp"], last["dp"], last["tp"], last["ep"]) == (1, 3, 1, 1)
    assert rank_coordinates(dims, 2)["ep"] == 1 and rank_coordinates(dims, 4)["dp_expert"] == 1


@pytest.mark.parametrize("stage,expected", [(0, (4, 4, 8)), (1, (4, 4, 2)), (2, (4, 1, 2)), (3, (1, 1, 2))])
def test_zero_formulas(stage, expected):
    config = load_config(None, [*BASE, f"parallel.zero_stage={stage}"])
    dims = resolve_dims(config, 4)
    state = predicted_state_bytes(1000, dims)
    assert tuple(state[k] / 1000 for k in ("parameters", "gradients", "optimizer")) == expected


def test_inspect_prints_the_per_rank_plan(capsys):
    assert inspect_main([*BASE, "parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=3"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 4: dp_shard=2 x tp=2, ZeRO-3" in out
    assert "per-rank model state" in out
    assert inspect_main([*BASE, "parallel.tp=3", "parallel.dp_shard=1"]) == 2


@pytest.mark.parametrize("tie", [True, False])
def test_pipeline_ranks_hold_the_model_and_a_tied_copy(tie):
    from xscale.models.parameters import count_parameters

    config = load_config(None, [*BASE, "parallel.pp=2", "parallel.zero_stage=3", "parallel.microbatches=2",
                                f"model.tie_embeddings={str(tie).lower()}"])
    dims = resolve_dims(config, 4)
    total = count_parameters(config).total
    held = [count for count, _, _ in pipeline_rank_parameters(config, dims)]
    assert sum(held) == total + (config.model.vocab_size * config.model.d_model if tie else 0)
    state = predicted_pipeline_state_bytes(config, dims)
    assert [s["parameters"] for s in state] == [4 * count / 2 for count in held]  # ZeRO-3 over dp_shard=2


def test_inspect_prints_each_pipeline_rank_state(capsys):
    assert inspect_main([*BASE, "parallel.pp=2", "parallel.zero_stage=3", "parallel.microbatches=2",
                         "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 4: pp=2 x dp_shard=2, ZeRO-3" in out and "  pp 0: parameters" in out and "  pp 1:" in out


def test_inspect_plans_pipeline_x_tensor_x_data_parallel(capsys):
    """Each rank's stage (layers, embedding, head) and tensor-parallel share (heads, vocabulary rows)."""
    assert inspect_main(["--world-size", "8", *BASE, "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2",
                         "parallel.microbatches=2"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 8: pp=2 x dp_shard=2 x tp=2" in out
    assert "     2   0   1   0   0  stage 0 (embedding, layers 0-1); heads 0-1, vocab 0-31" in out
    assert "     5   1   0   1   0  stage 1 (layers 2-3, head); heads 2-3, vocab 32-63" in out


def test_encoder_decoder_pipeline_ranks_hold_both_stacks_and_the_embedding_copies(capsys):
    """The stages cut encoder then decoder layers; the first decoder stage holds its own copy of the embedding,
    counted in its rank's state, as the last stage's tied output copy is."""
    from xscale.models.parameters import count_parameters

    overrides = [*BASE, "model.family=encoder_decoder", "model.position=learned", "model.n_layers=2",
                 "model.n_decoder_layers=3", "parallel.pp=2", "parallel.pp_schedule=zero_bubble",
                 "parallel.pp_stages_per_rank=2", "parallel.pp_split=[1,1,2,1]", "parallel.zero_stage=1"]
    config = load_config(None, overrides)
    dims = resolve_dims(config, 4)
    held = [count for count, _, _ in pipeline_rank_parameters(config, dims)]
    embedding = config.model.vocab_size * config.model.d_model
    assert sum(held) == count_parameters(config).total + 2 * embedding  # the output copy and the decoder's
    assert len(predicted_pipeline_state_bytes(config, dims)) == 2
    assert inspect_main([*overrides, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "     0   0   0   0   0  stages 0 (embedding, layer 0), 3 (decoder layer 2, head)" in out
    assert "     2   1   0   0   0  stages 1 (layer 1), 2 (embedding copy, decoder layers 0-1)" in out


@pytest.mark.parametrize("zero_stage,suffix", [
    (3, " (at rest 1/2 of their weights, ZeRO-3 over dp_expert=2)"),
    (1, ""),
])
def test_inspect_says_which_experts_a_rank_holds_and_how_zero3_splits_them(zero_stage, suffix, capsys):
    assert inspect_main(["--world-size", "4", *BASE, "model.moe.num_experts=8", "parallel.dp_shard=4", "parallel.ep=2",
                         f"parallel.zero_stage={zero_stage}"]) == 0
    out = capsys.readouterr().out
    assert f"     1   0   1   0   1  layers 0-3; experts 4-7{suffix}\n" in out
