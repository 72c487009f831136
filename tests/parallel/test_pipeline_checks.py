"""Pipeline layouts refused or resolved before anything is built: schedules, stages per rank, splits and the
microbatch count (set, or resolved to the fewest the schedule runs)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from xscale.config.load import load_config
from xscale.config.schema import (
    AttentionConfig,
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from xscale.parallel.checks import resolve_dims, resolve_layout
from xscale.parallel.pipeline import SCHEDULES, check_pipeline, resolve_microbatches, split_layers


def decoder_config(n_layers: int) -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       max_seq_len=16, position="rope", norm="rmsnorm", ffn="swiglu", tie_embeddings=True)


def pipeline_config(**overrides) -> Config:
    model = {key[6:]: value for key, value in overrides.items() if key.startswith("model_")}
    moe = model.pop("moe", None)
    parallel = {key: value for key, value in overrides.items() if not key.startswith(("model_", "train_"))}
    train = {key[6:]: value for key, value in overrides.items() if key.startswith("train_")}
    model_config = decoder_config(model.pop("n_layers", 4))
    for key, value in model.items():
        setattr(model_config, key, value)
    if moe is not None:
        model_config.moe = moe
    return Config(model=model_config, parallel=ParallelConfig(**{"pp": 2, "microbatches": 4, **parallel}),
                  train=TrainConfig(**{"global_batch_size": 8, **train}))


@pytest.mark.parametrize("overrides, message", [
    ({"model_family": "encoder_decoder", "model_n_decoder_layers": 1, "model_n_layers": 2, "pp_split": [1, 1]},
     r"sums to 2 blocks but model.n_layers \+ the decoder's layers \(2 \+ 1\)=3"),
    ({"model_share_layers": True, "model_attention": AttentionConfig(kind="routing")},
     r"routing attention in a shared block \(model.share_layers\)"),
    ({"model_n_layers": 1}, "cannot fill 2 pipeline stages"),
    ({"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2, "model_n_layers": 3}, "cannot fill 4"),
    ({"pp_split": [3, 2]}, "sums to 5"),
    ({"pp_split": [4]}, "has 1 entries"),
    ({"pp_split": [4, 0]}, "at least one block"),
    ({"pp_schedule": "1f1b", "microbatches": 1}, "at least parallel.pp=2 microbatches"),
    ({"pp_schedule": "zero_bubble", "pp_stages_per_rank": 2, "microbatches": 1}, "at least parallel.pp=2"),
    ({"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 1}, "needs 2 or more stages per rank"),
    ({"pp_schedule": "zero_bubble", "pp_stages_per_rank": 1}, "needs exactly 2 stages per rank"),
    ({"pp_schedule": "1f1b", "pp_stages_per_rank": 2}, "interleaved_1f1b or zero_bubble"),
    ({"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2, "microbatches": 5, "train_global_batch_size": 10},
     "not a whole number of rounds"),
    ({"microbatches": 0}, "must be >= 1"),
    ({"microbatches": 3, "dp_shard": 1}, "does not split into parallel.microbatches=3"),
    ({"dp_shard": 3}, "does not split over 3 data-parallel ranks"),
    ({"dp_shard": 1, "train_micro_batch_size": 1}, "leave train.micro_batch_size unset"),
    ({"pp": 0}, "parallel.pp must be >= 1"),
])
def test_check_pipeline_refuses(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_pipeline(pipeline_config(**overrides))


def test_check_pipeline_accepts_runnable_layouts() -> None:
    check_pipeline(pipeline_config())
    check_pipeline(pipeline_config(pp_schedule="gpipe", microbatches=1, dp_shard=2))
    check_pipeline(pipeline_config(pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_split=[1, 1, 1, 1]))
    check_pipeline(pipeline_config(pp_schedule="zero_bubble", pp_stages_per_rank=2, dp_shard=2))
    check_pipeline(pipeline_config(model_share_layers=True))  # every stage holds the shared block
    check_pipeline(pipeline_config(model_attention=AttentionConfig(kind="routing")))  # replays keep their centroids
    check_pipeline(pipeline_config(model_family="encoder_decoder", model_n_decoder_layers=2, model_position="alibi",
                                   model_attention=AttentionConfig(kind="realformer")))  # scores travel per stack
    # Encoder-decoder: the stages cut encoder then decoder layers (2 + 2 here), the cut anywhere.
    check_pipeline(pipeline_config(model_family="encoder_decoder", model_n_layers=2, model_position="learned"))
    check_pipeline(pipeline_config(model_family="encoder_decoder", model_n_layers=1, model_n_decoder_layers=3,
                                   pp_schedule="zero_bubble", pp_stages_per_rank=2))


def test_check_pipeline_uses_the_known_data_parallel_degree() -> None:
    with pytest.raises(ConfigError, match="does not split into parallel.microbatches=4"):
        check_pipeline(pipeline_config(), data_parallel=4)


AUTO_CASES = [  # schedule, pp, stages per rank, fewest microbatches the schedule runs (batch 24 per rank)
    ("gpipe", 2, 1, 1),
    ("gpipe", 4, 1, 1),
    ("1f1b", 2, 1, 2),
    ("1f1b", 4, 1, 4),
    ("interleaved_1f1b", 2, 2, 2),
    ("interleaved_1f1b", 2, 3, 2),
    ("interleaved_1f1b", 4, 2, 4),
    ("zero_bubble", 2, 2, 2),
    ("zero_bubble", 4, 2, 4),
]


@pytest.mark.parametrize("schedule, pp, stages_per_rank, expected", AUTO_CASES)
def test_unset_microbatches_resolve_to_the_fewest_the_schedule_runs(schedule, pp, stages_per_rank, expected):
    config = pipeline_config(pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank, microbatches=None,
                             dp_shard=1, model_n_layers=pp * stages_per_rank, train_global_batch_size=24)
    assert resolve_microbatches(config) == expected
    check_pipeline(config)  # accepted as is (resolved the same way inside)
    assert config.parallel.microbatches is None  # checking does not write; ParallelDims.from_config does
    # One fewer is what the explicit check refuses.
    if expected > 1:
        config.parallel.microbatches = expected - 1
        with pytest.raises(ConfigError, match=f"at least parallel.pp={pp} microbatches"):
            check_pipeline(config)


@pytest.mark.parametrize("schedule, stages_per_rank, global_batch, data_parallel, expected", [
    ("1f1b", 1, 6, 2, 3),  # 3 sequences per rank: 2 does not divide them, 3 does
    ("1f1b", 1, 9, 1, 3),
    ("gpipe", 1, 6, 2, 1),
    ("interleaved_1f1b", 2, 9, 1, 3),  # one round of 3
    ("zero_bubble", 2, 18, 2, 3),
])
def test_unset_microbatches_divide_each_data_parallel_rank_batch(schedule, stages_per_rank, global_batch,
                                                                  data_parallel, expected):
    config = pipeline_config(pp=2, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank, microbatches=None,
                             dp_shard=data_parallel, train_global_batch_size=global_batch)
    assert resolve_microbatches(config, data_parallel) == expected
    check_pipeline(config, data_parallel)


def test_unset_microbatches_without_a_fitting_count_say_what_to_set():
    config = pipeline_config(pp=4, microbatches=None, dp_shard=1, train_global_batch_size=2)
    message = ("parallel.microbatches is unset (auto) and no count fits: parallel.pp_schedule=1f1b needs at least 4 "
               "microbatches, but each data-parallel rank's batch of 2 sequences (train.global_batch_size=2 / 1 "
               "data-parallel ranks) splits only into [1, 2]; set train.global_batch_size to a multiple of 4, or "
               "parallel.pp_schedule=gpipe")
    for check in (lambda: resolve_microbatches(config, 1), lambda: check_pipeline(config)):
        with pytest.raises(ConfigError) as error:
            check()
        assert str(error.value) == message
    with pytest.raises(ConfigError, match=r"2 sequences .* multiple of 8, or parallel.pp_schedule=gpipe"):
        resolve_dims(load_config(None, [*TINY, "parallel.pp=4", "train.global_batch_size=4"]), 8)


TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "train.seq_len=16",
        "train.global_batch_size=8", "data.dataset=copy"]


@pytest.mark.parametrize("layout, world_size, expected", [
    (["parallel.pp=2"], 2, 2),
    (["parallel.pp=2"], 4, 2),  # dp_shard=-1 -> 2
    (["parallel.pp=4"], 4, 4),
    (["parallel.pp=2", "parallel.pp_schedule=gpipe"], 2, 1),
    (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2"], 2, 2),
    (["parallel.pp=2", "train.global_batch_size=6", "parallel.dp_shard=2"], 4, 3),
    ([], 1, 1),
    (["parallel.dp_shard=2"], 2, 1),
])
def test_the_resolved_count_is_in_the_dims_and_the_resolved_copy_not_the_given_config(layout, world_size, expected):
    config = load_config(None, [*TINY, *layout])
    assert config.parallel.microbatches is None  # the default: auto
    assert resolve_dims(config, world_size).microbatches == expected
    dims, resolved = resolve_layout(config, world_size)
    assert dims.microbatches == resolved.parallel.microbatches == expected
    assert config.parallel.microbatches is None  # the caller's config is left as given
    assert resolved.model is config.model and resolved.train is config.train


@pytest.mark.parametrize("value, message", [
    (1, "parallel.pp_schedule=1f1b needs at least parallel.pp=2 microbatches, got parallel.microbatches=1; raise it "
        "(more also shrinks the bubble)"),
    (3, "each data-parallel rank's batch of 8 sequences (train.global_batch_size / data parallel) does not split "
        "into parallel.microbatches=3; pick microbatches from [1, 2, 4, 8]"),
    (0, "parallel.microbatches must be >= 1, got 0"),
])
def test_a_set_microbatch_count_is_validated_as_given(value, message):
    config = load_config(None, [*TINY, "parallel.pp=2", f"parallel.microbatches={value}"])
    with pytest.raises(ConfigError) as error:
        resolve_dims(config, 2)
    assert str(error.value) == message
    assert config.parallel.microbatches == value  # never replaced
    config = load_config(None, [*TINY, "parallel.pp=2", "parallel.microbatches=8"])
    assert resolve_dims(config, 2).microbatches == 8
    assert config.parallel.microbatches == 8


def test_split_layers() -> None:
    assert split_layers(3, 2, None) == [[0, 1], [2]]
    assert split_layers(5, 4, None) == [[0, 1], [2], [3], [4]]
    assert split_layers(4, 2, None) == [[0, 1], [2, 3]]
    assert split_layers(4, 2, [1, 3]) == [[0], [1, 2, 3]]
    with pytest.raises(ConfigError, match="cannot fill 3 pipeline stages"):
        split_layers(2, 3, None)


def test_every_schedule_names_a_torch_schedule_of_its_stage_count():
    """SCHEDULES names torch's classes (imported when a schedule is built): each name is torch's, one-stage schedules
    are PipelineScheduleSingle's and the others PipelineScheduleMulti's."""
    for name, spec in SCHEDULES.items():
        assert issubclass(spec.cls, PipelineScheduleSingle if spec.single_stage else PipelineScheduleMulti), name
