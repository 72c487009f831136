"""Checkpoints that reshard: save at one layout, resume at another; the resumed steps equal the uninterrupted run
and every sample of the epoch is read exactly once over the two halves (the sampler state reshards with dp)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from recorded_training import train_recording

from xscale.commands.parity import PARITY_SETTINGS, layout_overrides, run_local, world_size_of
from xscale.config.load import load_config

SAMPLES, GLOBAL_BATCH, STEPS = 64, 8, 8  # 8 steps of 8 = one epoch
MODEL = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         f"train.global_batch_size={GLOBAL_BATCH}", "train.seq_len=16", "train.warmup_steps=2", "train.lr=3e-3",
         "data.dataset=copy", f"data.num_samples={SAMPLES}", "data.eval_fraction=0.0", f"train.steps={STEPS}"]
RTOL = 1e-5
VOCABULARY_STAGES = "microbatches=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,pp_vocab_parallel=true"


def _seen_per_data_parallel_rank(ranks: list[dict]) -> list[list[int]]:
    """The samples each data-parallel rank read; its tensor and pipeline peers must have read the same ones."""
    by_dp_rank: dict[int, list[int]] = {}
    for rank in ranks:
        seen = by_dp_rank.setdefault(rank["dp_rank"], rank["seen"])
        assert seen == rank["seen"], f"ranks of data-parallel rank {rank['dp_rank']} read different samples"
    return list(by_dp_rank.values())


def _run(layout: str, output_dir: Path, *extra: str, model: list[str] = MODEL) -> list[dict]:
    config = load_config(None, [*model, *PARITY_SETTINGS, *layout_overrides(layout), f"train.output_dir={output_dir}",
                                *extra])
    config.checkpoint.resume = "auto"
    return run_local(train_recording, world_size_of(config), config)


def check_resharding(save_layout: str, resume_layout: str, tmp_path: Path, model: list[str] = MODEL,
                     reference: tuple[str, ...] = ()) -> None:
    """``model``: overrides of the model and data (8 steps of a 64-sample epoch, global batch 8); ``reference``:
    overrides of the uninterrupted single-process run only (e.g. its micro_batch_size, to route as the layouts do)."""
    reference = _run("single", tmp_path / "reference", *reference, model=model)[0]["losses"]
    first = _run(save_layout, tmp_path / "run", "checkpoint.every=4", model=model)
    checkpoints = tmp_path / "run" / "checkpoints"
    for step_dir in checkpoints.glob("step_*"):
        if step_dir.name != "step_00000004":
            for file in sorted(step_dir.rglob("*"), reverse=True):
                file.unlink() if file.is_file() else file.rmdir()
            step_dir.rmdir()
    (checkpoints / "latest").write_text("step_00000004\n")  # as if the first run died after step 4
    second = _run(resume_layout, tmp_path / "run", model=model)
    losses = second[0]["losses"]
    assert len(losses) == STEPS - 4
    for step, (expected, got) in enumerate(zip(reference[4:], losses), start=5):
        assert abs(got - expected) <= RTOL * abs(expected), f"step {step}: {got} after resume vs {expected}"
    first_half = Counter(i for seen in _seen_per_data_parallel_rank(first) for i in seen[: len(seen) // 2])
    second_half = Counter(i for seen in _seen_per_data_parallel_rank(second) for i in seen)
    seen = first_half + second_half
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, \
        f"samples read twice: {[i for i, n in seen.items() if n > 1]}, never: {set(range(SAMPLES)) - set(seen)}"


@pytest.mark.parametrize("save_layout,resume_layout", [
    ("dp_shard=2,zero_stage=3", "single"),
    ("dp_shard=2,zero_stage=1", "dp_shard=2,zero_stage=3"),
    ("tp=2", "dp_shard=2"),
    ("pp=2,microbatches=2", "tp=2"),
])
def test_resume_at_another_layout(save_layout, resume_layout, tmp_path):
    check_resharding(save_layout, resume_layout, tmp_path)


@pytest.mark.parametrize("save_layout", [
    "pp=2,microbatches=2",
    pytest.param("pp=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,microbatches=2", marks=pytest.mark.slow),
])
def test_t5_bias_table_saved_by_a_pipeline_resumes_on_one_process(save_layout, tmp_path):
    """Every stage holds a copy of T5's table (two on a rank of the interleaved schedule); the checkpoint holds
    one, under the single-process name."""
    check_resharding(save_layout, "single", tmp_path, model=[*MODEL, "model.position=t5_bias", "model.n_layers=4"])


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,resume_layout", [
    ("dp_shard=4,zero_stage=3", "dp_shard=2,zero_stage=3"),
    ("dp_replicate=2,dp_shard=2,zero_stage=2", "single"),
    ("single", "dp_shard=4,zero_stage=2"),
    ("pp=2,dp_shard=2,microbatches=2,zero_stage=3,activation_checkpointing=full", "dp_shard=2,zero_stage=3"),
    ("dp_shard=2,zero_stage=1", "pp=2,dp_shard=2,microbatches=2,zero_stage=3"),
    ("pp=2,tp=2,sequence_parallel=true,microbatches=2", "single"),
    # vocabulary stages: each pp rank's rows of the tied projection and of its moments, themselves sharded over dp
    (f"pp=2,dp_shard=2,zero_stage=3,{VOCABULARY_STAGES}", "dp_shard=2,zero_stage=1"),
    ("single", f"pp=2,dp_shard=2,zero_stage=3,{VOCABULARY_STAGES}"),
    # ... and over tp
    (f"pp=2,tp=2,{VOCABULARY_STAGES}", "single"),
    ("single", f"pp=2,tp=2,sequence_parallel=true,{VOCABULARY_STAGES}"),
])
def test_resume_at_another_world_size(save_layout, resume_layout, tmp_path):
    check_resharding(save_layout, resume_layout, tmp_path)


@pytest.mark.parametrize("save_layout,resume_layout", [
    ("pp=2,microbatches=2", "single"),
    # Two stages per rank: each rank holds the shared block twice, saved once; one process's block resumes on both.
    pytest.param("single", "pp=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,microbatches=2",
                 marks=pytest.mark.slow),
])
def test_shared_layers_checkpoint_moves_between_pipeline_and_one_process(save_layout, resume_layout, tmp_path):
    """Every stage holds a copy of the shared block (``model.share_layers``); the checkpoint holds it once, under
    the single-process name."""
    check_resharding(save_layout, resume_layout, tmp_path, model=[*MODEL, "model.share_layers=true",
                                                                  "model.n_layers=4"])


@pytest.mark.parametrize("save_layout,resume_layout", [
    ("pp=2,microbatches=2,activation_checkpointing=full", "single"),
    pytest.param("single", "pp=2,microbatches=2", marks=pytest.mark.slow),
])
def test_routing_centroids_move_between_pipeline_and_one_process(save_layout, resume_layout, tmp_path):
    """Routing attention's centroids (and pending statistics) are buffers of the stage holding the layer, saved
    and resumed under the single-process names; every run routes in microbatches of 4 rows."""
    routing = ["model.attention.kind=routing", "model.attention.options={clusters: 2, window: 4, decay: 0.5}",
               "train.micro_batch_size=4"]
    check_resharding(save_layout, resume_layout, tmp_path, model=[*MODEL, *routing])


ENCODER_DECODER = ["model.family=encoder_decoder", "model.n_decoder_layers=2", "model.position=learned",
                   "model.max_seq_len=16", "model.embedding_norm=true"]


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,resume_layout", [
    # Rank 0 holds the embedding (stage 0) and the decoder's copy of it (stage 2): saved once, resumed on one process.
    ("pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2", "single"),
    # The single process's embedding resumes as the first decoder stage's copy on rank 1 too.
    ("single", "pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2"),
    # Vocabulary stages: both embedding holders (ranks 0 and 1 under the V) rebuild the tied moments from the rows.
    ("single", "pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,pp_vocab_parallel=true"),
    ("pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,pp_vocab_parallel=true", "single"),
])
def test_encoder_decoder_pipeline_checkpoints_move_between_layouts(save_layout, resume_layout, tmp_path):
    check_resharding(save_layout, resume_layout, tmp_path, model=[*MODEL, *ENCODER_DECODER])


# Per-head state split by head under tp: routing's centroids (buffers moved every step) in layer 0, the
# Synthesizer's weights in layer 1.
PER_HEAD_STATE = [*MODEL, "model.attention.kind=routing", "model.attention.per_layer=[routing,synthesizer]",
                  "model.attention.options={clusters: 2, window: 8, decay: 0.5, mode: dense}", "model.max_seq_len=16"]


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,resume_layout", [("tp=2", "single"), ("single", "tp=2,sequence_parallel=true")])
def test_per_head_state_reshards_between_tensor_parallel_and_one_process(save_layout, resume_layout, tmp_path):
    check_resharding(save_layout, resume_layout, tmp_path, model=PER_HEAD_STATE)
