"""Pipeline parallelism (pp=2, gloo): every schedule gives the single-process loss and gradients.

Each spawned case compares the pipeline with the trainer's step on one process running the same model
on the same batch: the loss (relative 1e-5), every parameter (exactly: same init) and every gradient
(1e-5 absolute), for a decoder (RoPE, SwiGLU, RMSNorm, GQA, tied embeddings, fused linear CE) and a
BERT-style encoder (learned positions, post-LN, embedding norm, MLM head with bias, tied, labels
mostly -100), a decoder with T5's relative bias table (every stage holds a copy), a RealFormer decoder
(stages send their attention scores with the hidden states), and encoder-decoders (learned, sinusoidal or T5
positions, tied embeddings) whose stage boundaries fall inside the encoder, inside the decoder and exactly between
the two. Splits are uneven.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from spawned import WORLD, spawn

from xscale.config.schema import AttentionConfig, Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from xscale.models import build_model
from xscale.models.init import canonical_name
from xscale.parallel.model import ParallelModel
from xscale.parallel.pipeline import PipelineSchedule
from xscale.parallel.pipeline.vocabulary import VocabularyShard
from xscale.train.optim import build_optimizer
from xscale.train.step import clip_gradient_norm, evaluation_loss, forward_backward_step

SEED = 7
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 0.0}
GRAD_TOLERANCE = {"rtol": 0.0, "atol": 1e-5}
# Weights after AdamW steps: Adam divides by sqrt(v), so where a gradient is near zero the rounding of another
# summation order (microbatches, stages) moves a weight by ~1e-5, on the AVX2 kind up to 1e-4 (2 of 1024 elements,
# interleaved 1F1B with T5 biases); a wrong gradient moves them by ~lr = 1e-2.
WEIGHT_TOLERANCE = {"rtol": 0.0, "atol": 2e-4}


def decoder_config(n_layers: int) -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       max_seq_len=16, position="rope", norm="rmsnorm", ffn="swiglu", tie_embeddings=True)


def encoder_config(n_layers: int) -> ModelConfig:
    return ModelConfig(family="encoder", vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, max_seq_len=16,
                       position="learned", norm="layernorm", norm_placement="post", embedding_norm=True,
                       ffn="gelu", bias=True, tie_embeddings=True, lm_head_transform=True, lm_head_bias=True)


def encoder_decoder_config(n_layers: int, n_decoder_layers: int, position: str = "learned",
                           embedding_norm: bool = False) -> ModelConfig:
    return ModelConfig(family="encoder_decoder", vocab_size=64, d_model=32, n_layers=n_layers,
                       n_decoder_layers=n_decoder_layers, n_heads=4, max_seq_len=16, position=position,
                       norm="rmsnorm", ffn="swiglu", embedding_norm=embedding_norm, tie_embeddings=True)


def t5_decoder_config(n_layers: int) -> ModelConfig:
    config = decoder_config(n_layers)
    config.position = "t5_bias"
    return config


def realformer_config(n_layers: int) -> ModelConfig:
    config = decoder_config(n_layers)
    config.position = "alibi"
    config.attention = AttentionConfig(kind="realformer")
    return config


def make_batch(config: ModelConfig, rows: int = 4, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (rows, seq), generator=generator)
    labels = torch.randint(0, config.vocab_size, (rows, seq), generator=generator)
    if config.family == "encoder":  # MLM: ~20% of positions carry a label; the first sequence none at all
        labels[torch.rand(rows, seq, generator=generator) > 0.2] = -100
        labels[0] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    if config.family == "encoder_decoder":  # a shorter target than the source, some of it padding
        batch["decoder_input_ids"] = torch.randint(0, config.vocab_size, (rows, seq - 4), generator=generator)
        batch["labels"] = labels[:, :seq - 4]
        batch["labels"][1, -3:] = -100
    return batch


def pipeline_model(config: ModelConfig, microbatches: int, schedule: str, stages_per_rank: int = 1, *,
                   seed: int = SEED, pp_split: list[int] | None = None, autocast_dtype: torch.dtype | None = None,
                   **kwargs) -> ParallelModel:
    """This rank's stages of ``config`` over the whole world (pp = world size), without data parallelism."""
    pipeline = PipelineSchedule.for_model(config, build_model(config, materialize=False), dist.group.WORLD,
                                          microbatches, schedule, stages_per_rank, seed=seed, pp_split=pp_split,
                                          **kwargs)
    return ParallelModel(pipeline.stages, micro_batch_size=0, autocast_dtype=autocast_dtype, pipeline=pipeline)


def single_process_names(config: ModelConfig) -> set[str]:
    """Parameter names of the 1-process model, the tied output projection included."""
    return set(build_model(config, materialize=False).state_dict())


def gathered_names(engine: ParallelModel) -> set[str]:
    names = [name for stage in engine.pipeline.stages for name, _ in stage.named_parameters(remove_duplicate=False)]
    everyone: list[list[str]] = [[] for _ in range(WORLD)]
    dist.all_gather_object(everyone, names, group=engine.pipeline.group)
    shared = {entry.name for entry in engine.pipeline.shared.shared}  # a copy on several stages (T5's table)
    flat = [name for names in everyone for name in names]
    unshared = [name for name in flat if name not in shared]
    assert len(unshared) == len(set(unshared)), "a parameter is held by two stages"
    return {name for name in flat}


def assert_copies_equal(engine: ParallelModel) -> None:
    """Every copy of a shared parameter (tied embedding ends, T5 table) is bitwise the same on every pp rank; a
    copy of some rows (a vocabulary stage's) equals those rows of the whole copies."""
    for entry in engine.pipeline.shared.shared:
        mine = [(copy_.detach().clone(), rows) for copy_, rows in engine.pipeline.shared.held_copies(entry)]
        everyone: list = [None] * WORLD
        dist.all_gather_object(everyone, mine, group=engine.pipeline.group)
        held = [pair for pairs in everyone for pair in pairs]
        whole = [copy_ for copy_, rows in held if rows is None]
        assert whole, f"no stage holds all of {entry.name}"
        for copy_, rows in held:
            expected = whole[0] if rows is None else whole[0][rows[0]:rows[1]]
            assert torch.equal(copy_, expected), f"the copies of {entry.name} drifted apart"


def assert_matches_single(engine: ParallelModel, single: torch.nn.Module) -> None:
    """Every parameter this rank holds equals the single-process one, and so does its gradient."""
    reference = dict(single.named_parameters())
    if single.config.tie_embeddings:
        reference["output.weight"] = single.embedding.weight
    for stage in engine.pipeline.stages:
        rows = slice(stage.start, stage.end) if isinstance(stage, VocabularyShard) else slice(None)
        for name, param in stage.named_parameters():
            name = canonical_name(name)  # activation checkpointing wraps blocks
            assert torch.equal(param.detach(), reference[name].detach()[rows]), f"{name}: initial weights differ"
            assert param.grad is not None, f"{name}: no gradient"
            torch.testing.assert_close(param.grad, reference[name].grad[rows], **GRAD_TOLERANCE, msg=name)


SCHEDULE_CASES = [  # schedule, stages per rank, microbatches, layers, pp_split
    ("gpipe", 1, 2, 3, [1, 2]),
    ("1f1b", 1, 2, 3, None),  # 3 layers over 2 stages, split by the cost model: [2, 1]
    ("interleaved_1f1b", 2, 4, 5, None),  # 5 layers over 4 stages, split by the cost model: [1, 2, 1, 1]
    ("zero_bubble", 2, 4, 5, [1, 1, 2, 1]),  # V placement: both ends of the tied embedding on rank 0
]


def check_case(config: ModelConfig, schedule: str, stages_per_rank: int, microbatches: int,
               pp_split: list[int] | None, reference_micro_batch: int = 4,
               autocast_dtype: torch.dtype | None = None) -> None:
    batch = make_batch(config)
    single = build_model(config, seed=SEED)
    reference = ParallelModel([single], micro_batch_size=reference_micro_batch, autocast_dtype=autocast_dtype)
    expected_loss = forward_backward_step(reference, batch)
    expected_eval = evaluation_loss(reference, batch)

    engine = pipeline_model(config, microbatches, schedule, stages_per_rank, pp_split=pp_split,
                            autocast_dtype=autocast_dtype)
    tolerance = LOSS_TOLERANCE if autocast_dtype is None else {"rtol": 1e-2, "atol": 0.0}
    torch.testing.assert_close(forward_backward_step(engine, batch), expected_loss, **tolerance)
    # A second step without zero_grad accumulates, as on one process.
    forward_backward_step(reference, batch)
    forward_backward_step(engine, batch)
    if autocast_dtype is None:
        assert_matches_single(engine, single)
    assert gathered_names(engine) == single_process_names(config)
    if autocast_dtype is None:
        assert_copies_equal(engine)
    torch.testing.assert_close(evaluation_loss(engine, batch), expected_eval, **tolerance)
    assert engine.pipeline.last_step_seconds > 0


def check_schedules(rank: int) -> None:
    for schedule, stages_per_rank, microbatches, n_layers, pp_split in SCHEDULE_CASES:
        for config in (decoder_config(n_layers), encoder_config(n_layers), t5_decoder_config(n_layers),
                       realformer_config(n_layers)):
            try:
                check_case(config, schedule, stages_per_rank, microbatches, pp_split)
            except AssertionError as error:
                kind = f"{config.family} ({config.position}, {config.attention.kind})"
                raise AssertionError(f"{schedule} on the {kind}: {error}") from error
    # RealFormer layers among dense ones (R D D R D over [2, 1, 1, 1]): the scores leave stage 0, pass through
    # stage 1 untouched, are read on stage 2, and stage 3 gets hidden states alone.
    mixed = realformer_config(5)
    mixed.attention = AttentionConfig(per_layer=["realformer", "dense", "dense"])
    check_case(mixed, "interleaved_1f1b", 2, 4, None)
    # MoE: routing (capacity, auxiliary losses) is per microbatch, as in the 1-process engine's accumulation;
    # zero bubble splits each backward into input and weight halves around the auxiliary-loss Function.
    moe = decoder_config(4)
    moe.moe = MoEConfig(num_experts=4, router="switch", capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01)
    check_case(moe, "zero_bubble", 2, 2, None, reference_micro_batch=2)
    # Hash routing: every stage routes microbatch k by microbatch k's token ids (later stages get hidden states).
    hashed = decoder_config(3)
    hashed.moe = MoEConfig(num_experts=4, router="hash", capacity_factor=1.0, min_capacity=0)
    check_case(hashed, "1f1b", 1, 2, None, reference_micro_batch=2)
    check_case(decoder_config(3), "1f1b", 1, 2, None, autocast_dtype=torch.bfloat16)
    for schedule, stages_per_rank, microbatches, (n_layers, n_decoder_layers), pp_split, config in ENCODER_DECODER:
        try:
            check_case(config(n_layers, n_decoder_layers), schedule, stages_per_rank, microbatches, pp_split)
        except AssertionError as error:
            raise AssertionError(f"{schedule} on the encoder-decoder split {pp_split}: {error}") from error
    # Hash routing in both stacks: decoder stages route microbatch k by its decoder_input_ids.
    hashed = encoder_decoder_config(2, 2)
    hashed.moe = MoEConfig(num_experts=4, router="hash", capacity_factor=1.0, min_capacity=0)
    check_case(hashed, "zero_bubble", 2, 2, None, reference_micro_batch=2)


ENCODER_DECODER = [  # schedule, stages per rank, microbatches, (encoder, decoder layers), pp_split, config
    ("gpipe", 1, 2, (2, 3), [2, 3], encoder_decoder_config),  # the cut exactly between encoder and decoder
    # A cut inside the encoder: rank 1 embeds decoder_input_ids with its copy of the embedding (and its norm).
    ("1f1b", 1, 2, (2, 2), [1, 3],
     lambda n, d: encoder_decoder_config(n, d, position="sinusoidal", embedding_norm=True)),
    # Stage 1 (rank 1) ends the encoder and starts the decoder; a cut inside the decoder.
    ("interleaved_1f1b", 2, 4, (2, 3), [1, 2, 1, 1], encoder_decoder_config),
    # Loop placement: the first decoder stage (2) on rank 0 beside the embedding's stage 0.
    ("interleaved_1f1b", 2, 2, (2, 3), [1, 1, 1, 2], encoder_decoder_config),
    # V placement: stages 0 and 3 on rank 0 (embedding and output copy), the decoder starting on rank 1.
    ("zero_bubble", 2, 4, (2, 3), [1, 1, 2, 1], encoder_decoder_config),
    # T5: stage 1 (rank 1) ends the encoder and starts the decoder, so it holds both stacks' bias tables; each
    # rank holds encoder and decoder stages, and sums its copies of each table before swapping them.
    ("interleaved_1f1b", 2, 4, (2, 3), [1, 2, 1, 1], lambda n, d: encoder_decoder_config(n, d, position="t5_bias")),
]


def test_every_schedule_matches_single_process() -> None:
    """One spawn for the whole matrix: starting processes costs more than the cases."""
    spawn(check_schedules)


def train_config() -> TrainConfig:
    return TrainConfig(lr=1e-2, weight_decay=0.1)


def single_process_run(config: ModelConfig, steps: int, max_norm: float):
    """The reference: ``steps`` AdamW steps with clipping on one process; (model, optimizer, losses, norms)."""
    model = build_model(config, seed=SEED)
    engine = ParallelModel([model], micro_batch_size=4)
    optimizer = build_optimizer(engine.parameters(), train_config())
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(forward_backward_step(engine, make_batch(config, seed=step)))
        norms.append(clip_gradient_norm(engine, max_norm))
        optimizer.step()
    return model, optimizer, losses, norms


def checkpoint_case_config(family: str, n_layers: int, position: str) -> ModelConfig:
    """A decoder, or an encoder-decoder with ``n_layers`` split between its stacks (the decoder the larger)."""
    if family == "encoder_decoder":
        return encoder_decoder_config(n_layers // 2, n_layers - n_layers // 2, position=position)
    config = decoder_config(n_layers)
    config.position = position
    return config


def check_training_and_checkpoint(rank: int, schedule: str, stages_per_rank: int, n_layers: int,
                                  folder: str, family: str, position: str) -> None:
    config = checkpoint_case_config(family, n_layers, position)
    steps, max_norm = 3, 0.5
    single, _, expected_losses, expected_norms = single_process_run(config, steps, max_norm)
    assert expected_norms[0] > max_norm, "the case must exercise clipping"

    layout = Config(model=config, train=TrainConfig(seed=SEED),
                    parallel=ParallelConfig(pp=WORLD, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank,
                                            microbatches=2))
    pipeline = PipelineSchedule(layout, build_model(config, materialize=False), dist.group.WORLD)
    engine = ParallelModel(pipeline.stages, micro_batch_size=0, pipeline=pipeline)
    optimizer = build_optimizer(engine.parameters(), train_config())
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward_step(engine, make_batch(config, seed=step))
        torch.testing.assert_close(loss, expected_losses[step], **LOSS_TOLERANCE)
        # the norm sums squares over every gradient in another order than one process: 1.06e-5 seen on the AVX2 kind
        torch.testing.assert_close(clip_gradient_norm(engine, max_norm), expected_norms[step], rtol=3e-5, atol=0.0)
        optimizer.step()
    reference = dict(single.named_parameters())
    reference["output.weight"] = single.embedding.weight
    for stage in engine.pipeline.stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.detach(), reference[name].detach(),
                                       **WEIGHT_TOLERANCE, msg=lambda text, name=name: f"{name}: {text}")
    assert_copies_equal(engine)

    dcp.save(engine.state_dict(optimizer), checkpoint_id=f"{folder}/pipeline")
    values = {name: param.detach().clone() for stage in engine.pipeline.stages for name, param in stage.named_parameters()}
    moments = {name: optimizer.state[param]["exp_avg_sq"].clone()
               for stage in engine.pipeline.stages for name, param in stage.named_parameters()}
    torch.save({"values": values, "moments": moments}, f"{folder}/rank{rank}.pt")

    # Resume from the single-process checkpoint into a fresh pipeline: exactly its weights and moments.
    fresh = pipeline_model(config, 2, schedule, stages_per_rank, seed=SEED + 1)
    fresh_optimizer = build_optimizer(fresh.parameters(), train_config())
    state = fresh.state_dict(fresh_optimizer)
    dcp.load(state, checkpoint_id=f"{folder}/single")
    fresh.load_state_dict(state, fresh_optimizer)
    saved = torch.load(f"{folder}/single.pt")
    for stage in fresh.pipeline.stages:
        for name, param in stage.named_parameters():
            source = "embedding.weight" if name == "output.weight" else name
            assert torch.equal(param.detach(), saved["values"][source]), name
            assert torch.equal(fresh_optimizer.state[param]["exp_avg_sq"], saved["moments"][source]), name
    for entry in fresh.pipeline.shared.shared:
        moments_of = [fresh_optimizer.state[param]["exp_avg"].data_ptr() for param in fresh.pipeline.shared.copies(entry)]
        assert len(set(moments_of)) == len(moments_of), f"copies of {entry.name} must not share optimizer state"


def save_single_process_checkpoint(config: ModelConfig, steps: int, folder: Path) -> None:
    model, optimizer, _, _ = single_process_run(config, steps, 0.5)
    dcp.save(ParallelModel([model], micro_batch_size=4).state_dict(optimizer), checkpoint_id=folder / "single")
    values = {name: param.detach().clone() for name, param in model.named_parameters()}
    moments = {name: optimizer.state[param]["exp_avg_sq"].clone() for name, param in model.named_parameters()}
    torch.save({"values": values, "moments": moments}, folder / "single.pt")


def checkpoint_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("schedule, stages_per_rank, n_layers, family, position", [
    ("1f1b", 1, 3, "decoder", "rope"),
    # T5's table: a copy on every stage, two on each rank; the norm counts it once, checkpoints hold it once.
    ("interleaved_1f1b", 2, 4, "decoder", "t5_bias"),
    pytest.param("zero_bubble", 2, 4, "decoder", "rope", marks=pytest.mark.slow),
    # The first decoder stage (2, on rank 1) holds a copy of the embedding: saved and resumed under its name.
    pytest.param("zero_bubble", 2, 4, "encoder_decoder", "learned", marks=pytest.mark.slow),
    pytest.param("1f1b", 1, 3, "encoder_decoder", "learned", marks=pytest.mark.slow),
    # Loop placement: rank 0 holds the embedding (stage 0) and the decoder's copy (stage 2), saved once.
    pytest.param("interleaved_1f1b", 2, 4, "encoder_decoder", "learned", marks=pytest.mark.slow),
    # T5: each rank holds an encoder stage (stack.position) and a decoder stage (decoder.position).
    pytest.param("interleaved_1f1b", 2, 4, "encoder_decoder", "t5_bias", marks=pytest.mark.slow),
])
def test_training_steps_and_checkpoint_match_single_process(tmp_path, schedule, stages_per_rank,
                                                             n_layers, family, position) -> None:
    config = checkpoint_case_config(family, n_layers, position)
    save_single_process_checkpoint(config, 3, tmp_path)
    spawn(check_training_and_checkpoint, schedule, stages_per_rank, n_layers, str(tmp_path), family, position)

    assert checkpoint_keys(tmp_path / "pipeline") == checkpoint_keys(tmp_path / "single")
    model = build_model(config, seed=SEED + 1)
    optimizer = build_optimizer(model.parameters(), train_config())
    engine = ParallelModel([model], micro_batch_size=4)
    state = engine.state_dict(optimizer)
    dcp.load(state, checkpoint_id=tmp_path / "pipeline")
    engine.load_state_dict(state, optimizer)
    saved = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for name, param in model.named_parameters():
        holders = [ranked for ranked in saved if name in ranked["values"]]
        assert holders, f"{name} is in no stage"
        assert torch.equal(param.detach(), holders[0]["values"][name]), name
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], holders[0]["moments"][name]), name


def test_checkpointed_stages_save_under_single_process_names() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from xscale.parallel.activation import apply_activation_checkpointing
    from xscale.parallel.pipeline.checkpoint import merged_view
    from xscale.parallel.pipeline.stages import build_stage_module

    config = decoder_config(2)
    meta = build_model(config, materialize=False)
    apply_activation_checkpointing([meta.stack], "full")  # block parameters named stack.layers.k._checkpoint_...
    stages = [build_stage_module(meta, [index], device="cpu", seed=SEED) for index in (0, 1)]
    assert set(get_model_state_dict(merged_view(stages))) == single_process_names(config)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpoint_view_names_activation_checkpointed_stages_like_one_process(mode) -> None:
    """The stages' state-dict view drops the checkpoint wrappers' level, so DCP resolves every name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from xscale.parallel.activation import apply_activation_checkpointing
    from xscale.parallel.pipeline.checkpoint import merged_view
    from xscale.parallel.pipeline.stages import build_stage_module

    config = decoder_config(2)
    meta = build_model(config, materialize=False)
    stages = [build_stage_module(meta, [index], device="cpu", seed=SEED,
                                 parallelize=lambda stage: apply_activation_checkpointing([stage.stack], mode))
              for index in (0, 1)]
    assert set(get_model_state_dict(merged_view(stages))) == single_process_names(config)


def shared_layers_config(config: ModelConfig) -> ModelConfig:
    config.share_layers = True
    return config


def check_shared_layers(rank: int) -> None:
    """ALBERT-style sharing: every stage holds the stack's one block and runs it at its own depths."""
    for schedule, stages_per_rank, microbatches, n_layers, pp_split in SCHEDULE_CASES[1:]:
        for config in (decoder_config(n_layers), encoder_config(n_layers)):
            try:
                check_case(shared_layers_config(config), schedule, stages_per_rank, microbatches, pp_split)
            except AssertionError as error:
                raise AssertionError(f"{schedule} on the shared-layer {config.family}: {error}") from error
    # Both stacks shared; stage 1 (rank 1) ends the encoder and starts the decoder, so it holds both blocks.
    check_case(shared_layers_config(encoder_decoder_config(2, 3)), "interleaved_1f1b", 2, 4, [1, 2, 1, 1])
    check_case(shared_layers_config(encoder_decoder_config(2, 3, position="t5_bias")), "zero_bubble", 2, 4,
               [1, 1, 2, 1])


def test_shared_layers_match_single_process() -> None:
    spawn(check_shared_layers)


def routing_config(n_layers: int) -> ModelConfig:
    """Routing attention whose centroids move far each forward (decay 0.5), so a replay with moved centroids
    routes differently."""
    config = decoder_config(n_layers)
    config.attention = AttentionConfig(kind="routing", options={"clusters": 2, "window": 4, "decay": 0.5})
    return config


def centroids_of(modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {canonical_name(name): buffer for module in modules for name, buffer in module.named_buffers()
            if name.endswith("centroids")}


def check_routing(rank: int, schedule: str, stages_per_rank: int, checkpointing: str) -> None:
    """Each stage routes microbatch k with the centroids moved by microbatches 0..k-1, as one process running the
    same microbatches does; a recomputation in backward (after later microbatches' forwards) routes with the
    centroids its forward used."""
    from xscale.parallel.activation import apply_activation_checkpointing

    config, microbatches = routing_config(4), 2
    single = build_model(config, seed=SEED)
    reference = ParallelModel([single], micro_batch_size=2)
    engine = pipeline_model(config, microbatches, schedule, stages_per_rank,
                            parallelize_stage=lambda stage: apply_activation_checkpointing([stage.stack], checkpointing))
    for step in range(3):
        batch = make_batch(config, seed=step)
        torch.testing.assert_close(forward_backward_step(engine, batch), forward_backward_step(reference, batch),
                                   **LOSS_TOLERANCE,
                                   msg=f"step {step}")
    assert_matches_single(engine, single)
    expected = centroids_of([single])
    for name, centroids in centroids_of(engine.pipeline.stages).items():
        torch.testing.assert_close(centroids, expected[name], rtol=0.0, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule, stages_per_rank, checkpointing", [
    ("1f1b", 1, "none"),
    ("1f1b", 1, "full"),
    pytest.param("interleaved_1f1b", 2, "selective", marks=pytest.mark.slow),
    pytest.param("zero_bubble", 2, "full", marks=pytest.mark.slow),
])
def test_routing_attention_matches_single_process(schedule, stages_per_rank, checkpointing) -> None:
    spawn(check_routing, schedule, stages_per_rank, checkpointing)


def realformer_encoder_decoder_config(n_layers: int, n_decoder_layers: int,
                                      per_layer: list[str] | None = None) -> ModelConfig:
    config = encoder_decoder_config(n_layers, n_decoder_layers, position="alibi")
    config.attention = AttentionConfig(kind="realformer", per_layer=per_layer)
    return config


def check_realformer_encoder_decoder(rank: int) -> None:
    """Each stack's RealFormer scores cross the stage boundaries inside it: (x, scores) inside the encoder,
    (decoder hidden, memory, scores) inside the decoder; the decoder starts its own."""
    # Stage 1 receives the encoder's scores and runs the whole decoder.
    check_case(realformer_encoder_decoder_config(2, 2), "1f1b", 1, 2, [1, 3])
    # Stage 1 ends the encoder and starts the decoder, whose scores then pass stages 2 and 3.
    check_case(realformer_encoder_decoder_config(2, 3), "interleaved_1f1b", 2, 4, [1, 2, 1, 1])
    # The cut at the encoder's end sends the memory alone; the decoder's scores cross from stage 2 to 3.
    check_case(realformer_encoder_decoder_config(2, 3), "zero_bubble", 2, 4, [1, 1, 2, 1])
    # R D R | D R D over [1, 1, 2, 2]: the encoder's scores pass stage 1 untouched (read by layer 2); in the decoder
    # (layers 3-5: D R D) no scores cross, and the decoder's first (dense) block leaves them unset.
    mixed = realformer_encoder_decoder_config(3, 3, per_layer=["realformer", "dense"])
    check_case(mixed, "interleaved_1f1b", 2, 4, [1, 1, 2, 2])


def test_realformer_encoder_decoder_matches_single_process() -> None:
    spawn(check_realformer_encoder_decoder)
