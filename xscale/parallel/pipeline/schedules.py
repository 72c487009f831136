"""Pipeline schedules (``parallel.pp_schedule``) and everything that can be refused before a stage is built.

Schedules come from ``torch.distributed.pipelining``:
  gpipe             all forwards, then all backwards (Huang et al. 2019)
  1f1b              one forward, one backward in steady state (PipeDream-Flush, Narayanan et al. 2021)
  interleaved_1f1b  several stages per rank, looped placement (Narayanan et al. 2021, sec. 2.2)
  zero_bubble       ZB-V: two stages per rank in a V, backward split into input and weight halves
                    that fill the bubble (Qi et al. 2024, sec. 6)

The table names torch's classes: importing ``torch.distributed.pipelining`` loads ``torch._dynamo`` (seconds), so
it is imported when a schedule is built (:attr:`ScheduleSpec.cls`), never by the checks and estimates every run makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.registry import ATTENTION
from xscale.models.traits import traits_of
from xscale.parallel.pipeline.stages import pipeline_layers, split_layers
from xscale.parallel.pipeline.vocabulary import every_shard_has_rows, vocabulary_rows


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule name's class, how its stages sit on the ranks, and what it demands."""

    torch_class: str  # its class in torch.distributed.pipelining
    placement: str  # loop: stage s on rank s % pp; v: down the ranks and back up
    min_stages_per_rank: int
    max_stages_per_rank: int | None
    # 1F1B-style schedules start a backward before all forwards are in: every stage needs a microbatch.
    needs_microbatch_per_stage: bool
    # torch 2.13's ZB-V passes gradients between the two same-rank stages of the V even when the schedule runs
    # forward only (``eval``), and fails with "can't steal_bwd_input if this stage doesn't have backward": its
    # evaluation keeps only the forward actions and their sends/receives (xscale.parallel.pipeline.runtime).
    eval_forward_only: bool = False
    # The last stage runs each microbatch's backward right after its forward, once: the fused loss may then
    # compute its gradient in the forward (xscale.ops.chunked_cross_entropy). Not under GPipe (every forward's
    # gradient would wait for the backwards), nor ZB-V (its split backward runs the loss's backward twice).
    loss_gradient_in_forward: bool = False
    # The backward runs in two halves (inputs, then weights) over one retained graph: compiled blocks must then keep
    # their saved buffers (AOTAutograd's buffer donation off), or the second half finds them freed.
    splits_backward: bool = False

    @property
    def cls(self) -> type:
        """torch's schedule class, imported now (module docstring)."""
        import torch.distributed.pipelining

        return getattr(torch.distributed.pipelining, self.torch_class)

    @property
    def single_stage(self) -> bool:
        return self.max_stages_per_rank == 1

    def accepts(self, stages_per_rank: int) -> bool:
        return self.min_stages_per_rank <= stages_per_rank <= (self.max_stages_per_rank or stages_per_rank)

    def stages_rule(self) -> str:
        if self.max_stages_per_rank == self.min_stages_per_rank:
            return f"exactly {self.min_stages_per_rank}"
        return f"{self.min_stages_per_rank} or more"


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "loop", 1, 1, needs_microbatch_per_stage=False),
    "1f1b": ScheduleSpec("Schedule1F1B", "loop", 1, 1, needs_microbatch_per_stage=True, loss_gradient_in_forward=True),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, None, needs_microbatch_per_stage=True),
    "zero_bubble": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, 2, needs_microbatch_per_stage=True,
                                eval_forward_only=True, splits_backward=True),
}


def check_pipeline(config: Config, data_parallel: int | None = None) -> None:
    """Refuse what cannot pipeline, before anything is built; each message says what to change.

    ``data_parallel``: the data-parallel degree when the caller knows it (else it is read from
    ``parallel.dp_replicate * parallel.dp_shard`` when dp_shard is fixed).
    """
    model, parallel, train = config.model, config.parallel, config.train
    if parallel.pp < 1:
        raise ConfigError(f"parallel.pp must be >= 1, got {parallel.pp}")
    if parallel.pp == 1:
        return
    layer_count = pipeline_layers(model)
    # A shared stack's one block is built as its first layer.
    shared_blocks = [0, model.n_layers] if model.family == "encoder_decoder" else [0]
    keeping = sorted({kind for kind in map(model.attention.kind_for_layer, shared_blocks)
                      if kind in ATTENTION and traits_of(ATTENTION.get(kind)).dp_statistics})
    if model.share_layers and keeping:
        raise ConfigError(f"{', '.join(keeping)} attention in a shared block (model.share_layers) moves its running "
                          "statistics (routing: its k-means centroids) at every depth, which pipeline stages holding "
                          "copies of the block would each see only part of; set model.share_layers=false or "
                          f"parallel.pp=1 with {', '.join(keeping)} attention")
    spec = SCHEDULES.get(parallel.pp_schedule)
    if spec is None:
        raise ConfigError(f"parallel.pp_schedule='{parallel.pp_schedule}' is not one of {', '.join(SCHEDULES)}")
    stages_per_rank = parallel.pp_stages_per_rank
    if not spec.accepts(stages_per_rank):
        hint = ("use parallel.pp_schedule=interleaved_1f1b or zero_bubble for several stages per rank"
                if stages_per_rank > 1 else "set parallel.pp_stages_per_rank=2, or use gpipe or 1f1b")
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule} needs {spec.stages_rule()} stages per rank, "
                          f"got parallel.pp_stages_per_rank={stages_per_rank}; {hint}")
    num_stages = parallel.pp * stages_per_rank
    if parallel.pp_vocab_parallel:
        check_vocabulary_parallel(config)
        num_stages -= parallel.pp  # the last pp stages hold vocabulary shards, no blocks
    split_layers(layer_count, num_stages, parallel.pp_split, layer_count_name(model))
    if data_parallel is None and parallel.dp_shard != -1:
        data_parallel = parallel.dp_replicate * parallel.dp_shard
    microbatches = resolve_microbatches(config, data_parallel)
    check_microbatches(parallel.pp_schedule, parallel.pp, stages_per_rank, microbatches)
    if data_parallel is not None:
        if train.global_batch_size % data_parallel:
            raise ConfigError(f"train.global_batch_size={train.global_batch_size} does not split over "
                              f"{data_parallel} data-parallel ranks; make it a multiple of {data_parallel}")
        local = train.global_batch_size // data_parallel
        if local % microbatches:
            raise ConfigError(
                f"each data-parallel rank's batch of {local} sequences (train.global_batch_size / data "
                f"parallel) does not split into parallel.microbatches={microbatches}; pick "
                f"microbatches from {[m for m in range(1, local + 1) if local % m == 0]}"
            )
        micro = train.micro_batch_size
        if micro is not None and micro != local // microbatches:
            raise ConfigError(
                f"train.micro_batch_size={micro} disagrees with the pipeline's microbatches of "
                f"{local // microbatches} sequences ({local} / parallel.microbatches); leave "
                f"train.micro_batch_size unset under pipeline parallelism"
            )


def check_vocabulary_parallel(config: Config) -> None:
    """What ``parallel.pp_vocab_parallel`` needs (:mod:`~xscale.parallel.pipeline.vocabulary`): a vocabulary
    stage on every pp rank after the block stages, so two or more stages per rank; a token loss (not a
    classifier's); rows for every pp rank, and for each of its tp ranks."""
    parallel, model = config.parallel, config.model
    if parallel.pp_stages_per_rank < 2:
        raise ConfigError(
            f"parallel.pp_vocab_parallel=true adds a vocabulary stage on every pp rank after the block stages, so it "
            f"needs 2 or more stages per rank (got parallel.pp_stages_per_rank={parallel.pp_stages_per_rank}): set "
            f"parallel.pp_stages_per_rank=2 with parallel.pp_schedule=interleaved_1f1b or zero_bubble")
    if model.num_classes:
        raise ConfigError("parallel.pp_vocab_parallel=true splits the output projection over the vocabulary; a "
                          "classifier (model.num_classes > 0) has none: set parallel.pp_vocab_parallel=false")
    if not model.vocab_size:  # automatic: padded to a multiple of 128 x tp x pp (xscale.data.vocab_size)
        return
    if not every_shard_has_rows(model.vocab_size, parallel.pp):
        raise ConfigError(f"parallel.pp_vocab_parallel=true gives each of parallel.pp={parallel.pp} ranks "
                          f"ceil(model.vocab_size / pp) rows of model.vocab_size={model.vocab_size}, which leaves the "
                          f"last ranks no rows; use fewer pp ranks or set it false")
    rows = [vocabulary_rows(model.vocab_size, rank, parallel.pp) for rank in range(parallel.pp)]
    if parallel.tp > 1 and not all(every_shard_has_rows(end - start, parallel.tp) for start, end in rows):
        raise ConfigError(f"parallel.pp_vocab_parallel=true with parallel.tp={parallel.tp}: some pp rank's "
                          f"{min(end - start for start, end in rows)} vocabulary rows leave a tp rank none; use "
                          f"fewer tp or pp ranks")


def layer_count_name(model: ModelConfig) -> str:
    """How messages name the layer count a pipeline splits."""
    if model.family == "encoder_decoder":
        return f"model.n_layers + the decoder's layers ({model.n_layers} + {model.decoder_layers})"
    return "model.n_layers"


def microbatch_problem(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` per step (None: it can)."""
    if microbatches < 1:
        return f"parallel.microbatches must be >= 1, got {microbatches}"
    spec = SCHEDULES[schedule]
    if spec.needs_microbatch_per_stage and microbatches < pp:
        return (f"parallel.pp_schedule={schedule} needs at least parallel.pp={pp} microbatches, got "
                f"parallel.microbatches={microbatches}; raise it (more also shrinks the bubble)")
    if spec.placement == "loop" and stages_per_rank > 1:
        # torch's interleaved 1F1B runs max(1, m // pp) rounds of equal size (ScheduleInterleaved1F1B).
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"parallel.pp_schedule={schedule} runs microbatches in rounds of parallel.pp={pp}; "
                    f"parallel.microbatches={microbatches} is not a whole number of rounds, use a multiple of {pp}")
    return None


def check_microbatches(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """The microbatch counts a schedule can run."""
    problem = microbatch_problem(schedule, pp, stages_per_rank, microbatches)
    if problem:
        raise ConfigError(problem)


def resolve_microbatches(config: Config, data_parallel: int | None = None) -> int:
    """``parallel.microbatches`` as set, or when unset (None, "auto") the fewest microbatches the schedule runs
    that split each data-parallel rank's batch (``train.global_batch_size / data_parallel``) evenly.

    The floor is what :func:`check_microbatches` accepts: 1 for gpipe and without a pipeline, parallel.pp for the
    1F1B-style schedules (each stage of the pp group needs a microbatch before the first backward). With ``data_parallel`` unknown (or not dividing the batch, which
    :func:`check_pipeline` refuses) the floor is returned. A set value is returned unchanged, to be validated as given.
    """
    parallel, train = config.parallel, config.train
    if parallel.microbatches is not None:
        return parallel.microbatches
    if parallel.pp <= 1 or parallel.pp_schedule not in SCHEDULES:
        return 1
    schedule, pp, stages_per_rank = parallel.pp_schedule, parallel.pp, parallel.pp_stages_per_rank

    def runs(count: int) -> bool:
        return microbatch_problem(schedule, pp, stages_per_rank, count) is None

    floor = next(count for count in range(1, pp + 1) if runs(count))  # pp always runs (one round)
    if data_parallel is None or data_parallel < 1 or train.global_batch_size % data_parallel:
        return floor
    local = train.global_batch_size // data_parallel
    divisors = [count for count in range(1, local + 1) if local % count == 0]
    fitting = [count for count in divisors if runs(count)]
    if not fitting:
        raise ConfigError(
            f"parallel.microbatches is unset (auto) and no count fits: parallel.pp_schedule={schedule} needs at least "
            f"{floor} microbatches, but each data-parallel rank's batch of {local} sequences "
            f"(train.global_batch_size={train.global_batch_size} / {data_parallel} data-parallel ranks) splits only "
            f"into {divisors}; set train.global_batch_size to a multiple of {data_parallel * floor}"
            + (", or parallel.pp_schedule=gpipe" if schedule != "gpipe" else ""))
    return fitting[0]


def ideal_bubble(pp: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages and free communication: (p-1)/(m+p-1) (Huang et al. 2019)."""
    return (pp - 1) / (microbatches + pp - 1)


