"""Pipeline parallelism: the Transformer's layers cut into stages over a ``pp`` group, run by a schedule.

Schedules (``parallel.pp_schedule``) come from ``torch.distributed.pipelining``:
  gpipe             all forwards, then all backwards (Huang et al. 2019)
  1f1b              one forward, one backward in steady state (PipeDream-Flush, Narayanan et al. 2021)
  interleaved_1f1b  several stages per rank, looped placement (Narayanan et al. 2021, sec. 2.2)
  zero_bubble       ZB-V: two stages per rank in a V, backward split into input and weight halves
                    that fill the bubble (Qi et al. 2024, sec. 6)

The engine keeps the :class:`~xscale.parallel.engine.Engine` contract: the loss it returns on every
pp rank and the gradients it leaves are the single-process model's on the whole batch. Each
microbatch's loss is its token cross-entropy SUM over the global count of labelled tokens, and the
schedule is told not to rescale (``scale_grads=False``), so gradients add up to the global mean.

Under tensor parallelism (each stage split over ``tp`` before it is initialised) the loss is
vocabulary-parallel, and what one stage sends the next is a plain local tensor: the microbatch's full
hidden states, or under sequence parallelism this tp rank's sequence shard (B/m, T/tp, D), always to
the same tp rank of the next stage, so PipelineStage infers the shapes from the first microbatch.

Every stage runs the model's own forward (:mod:`~xscale.parallel.pipeline_stages`) with, as keywords, the
microbatch's :class:`~xscale.runtime.StepContext` (its dropout position and token ids) and ``decoder_input_ids``,
which the first decoder stage of an encoder-decoder model embeds (every pp rank has the batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from xscale.config import Config, ConfigError, ModelConfig
from xscale.models.init import canonical_name
from xscale.models.training_step import begin_training_step
from xscale.models.transformer import Transformer
from xscale.parallel.engine import STATE_DICT_OPTIONS, Batch, Engine, Placement, unplaced
from xscale.parallel.expert_state import globalize_expert_state, localize_expert_state
from xscale.parallel.grad_norm import clip_gradients
from xscale.parallel.loss import token_loss_sum
from xscale.parallel.pipeline_checkpoint import (
    add_aliases,
    copies_to_sources,
    drop_aliases,
    merged_view,
    sources_to_copies,
)
from xscale.parallel.pipeline_shared import SharedParameterGrads, shared_block_modules, shared_parameters
from xscale.parallel.pipeline_stages import (
    build_stage_module,
    is_first,
    is_last,
    pipeline_layers,
    split_layers,
    stage_to_rank,
    whole_backward,
)
from xscale.runtime import StepContext

__all__ = ["SCHEDULES", "PipelineEngine", "check_pipeline", "ideal_bubble", "resolve_microbatches", "split_layers"]


class ForwardOnlyZBV(ScheduleZBVZeroBubble):
    """ZB-V's action list without its backward half, for evaluation.

    torch 2.13's runtime passes gradients between the two same-rank stages of the V even when the
    schedule runs forward only (``eval``), and fails with "can't steal_bwd_input if this stage doesn't
    have backward"; keeping only the forward actions and their sends/receives avoids it.
    """

    FORWARD_ACTIONS = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline_order_with_comms = {
            rank: [action for action in actions if action.computation_type.value in self.FORWARD_ACTIONS]
            for rank, actions in self.pipeline_order_with_comms.items()
        }


# The PipelineStage methods that compute (everything else a schedule does is communication or bookkeeping).
COMPUTE_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class QuietMetadataStage(PipelineStage):
    """A PipelineStage whose metadata-inference forward records no MoE routing statistics and leaves the stage's
    buffers as they were (routing attention's centroids and pending statistics): before its first step torch runs
    each stage once on the first microbatch (later stages: on uninitialised placeholders)."""

    def __init__(self, *args, pause_statistics: Callable[[], AbstractContextManager], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pause_statistics = pause_statistics

    def _prepare_forward_infra(self, *args, **kwargs):
        buffers = [(buffer, buffer.clone()) for buffer in self.submod.buffers()]
        try:
            with self.pause_statistics():
                return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule name's class, how its stages sit on the ranks, and what it demands."""

    cls: type
    placement: str  # loop: stage s on rank s % pp; v: down the ranks and back up
    min_stages_per_rank: int
    max_stages_per_rank: int | None
    # 1F1B-style schedules start a backward before all forwards are in: every stage needs a microbatch.
    needs_microbatch_per_stage: bool
    eval_cls: type | None = None

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
    "gpipe": ScheduleSpec(ScheduleGPipe, "loop", 1, 1, needs_microbatch_per_stage=False),
    "1f1b": ScheduleSpec(Schedule1F1B, "loop", 1, 1, needs_microbatch_per_stage=True),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, "loop", 2, None, needs_microbatch_per_stage=True),
    "zero_bubble": ScheduleSpec(ScheduleZBVZeroBubble, "v", 2, 2, needs_microbatch_per_stage=True,
                                eval_cls=ForwardOnlyZBV),
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
    if model.share_layers and any(model.attention.kind_for_layer(index) == "routing" for index in shared_blocks):
        raise ConfigError("routing attention in a shared block (model.share_layers) moves its k-means centroids at "
                          "every depth, which pipeline stages holding copies of the block would each see only part "
                          "of; set model.share_layers=false or parallel.pp=1 with routing attention")
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


def _pp_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(pp, DeviceMesh):
        if pp.ndim == 1:
            return pp.get_group()
        if "pp" not in (pp.mesh_dim_names or ()):
            raise ConfigError(f"pipeline parallelism needs a mesh dimension named 'pp'; this mesh has "
                              f"{pp.mesh_dim_names}")
        return pp["pp"].get_group()
    return pp


class MicrobatchStage(QuietMetadataStage):
    """A stage whose forward of microbatch k, whatever order the schedule runs microbatches in, gets that
    microbatch's context (dropout masks of its rows in the global batch, :mod:`xscale.models.dropout`; its token
    ids for hash routing) and ``decoder_input_ids`` as keywords of the model's forward."""

    engine: PipelineEngine
    _chunk = 0

    def _chunk_kwargs(self, index: int) -> dict:
        engine = self.engine
        rows = engine.rows_per_microbatch

        def part(ids: torch.Tensor) -> torch.Tensor | None:
            return ids[index * rows:(index + 1) * rows] if ids.numel() else None

        context = engine.place(engine.step_context.microbatch(index, rows) if engine.step_context else StepContext())
        return {"decoder_input_ids": part(engine.step_decoder_input_ids),
                "context": context.with_token_ids(part(engine.step_input_ids)), "project": False}

    def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None, has_backward: bool = False):
        # torch's shape inference runs the first microbatch
        return super()._prepare_forward_infra(num_microbatches, args, {**(kwargs or {}), **self._chunk_kwargs(0)},
                                              has_backward=has_backward)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._chunk = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args, **kwargs):
        return super().forward_maybe_with_nosync(*args, **kwargs, **self._chunk_kwargs(self._chunk))

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """A stage that embeds tokens midway (the first decoder stage, after the first stage) runs its whole
        backward in the input half of a split backward (zero bubble). torch finds the weight half's subgraphs
        from the stage's inputs, which the embedding's path does not pass through: the parameters on it would
        share unfreed subgraphs, as on the first stage, which torch also runs whole. So does a stage running a
        shared block (``model.share_layers``) at several depths: the weight half would start from each depth's use
        of a weight and run back through the earlier depths' graph, which the first parameter group frees."""
        if whole_backward(self.submod) and backward_type in ("input", "weight"):
            if backward_type == "weight":
                return (), None
            backward_type = "full"
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineEngine(Engine):
    """Forward and backward of one optimizer step through a pipeline schedule over the ``pp`` group.

    Every pp rank calls :meth:`train_step` with the same batch (this data-parallel rank's share):
    the first stage reads ``input_ids``, the last ``labels``. Data parallelism wraps
    :attr:`model_parts` from outside (gradient sync or FSDP); this engine does none.
    """

    def __init__(self, model_config: ModelConfig, meta_model: Transformer, pp: DeviceMesh | dist.ProcessGroup,
                 microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1,
                 device: torch.device | str = "cpu", seed: int = 0, pp_split: list[int] | None = None,
                 autocast_dtype: torch.dtype | None = None,
                 parallelize_stage: Callable[[Transformer], None] | None = None, place: Placement = unplaced) -> None:
        self.group = _pp_group(pp)
        self.pp_size, self.pp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.pp_size < 2:
            raise ConfigError(f"a pipeline needs a pp group of 2 or more ranks, got {self.pp_size}")
        if schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule='{schedule}' is not one of {', '.join(SCHEDULES)}")
        config = Config(model=model_config)
        parallel = config.parallel
        parallel.pp, parallel.pp_schedule, parallel.pp_stages_per_rank = self.pp_size, schedule, stages_per_rank
        parallel.pp_split, parallel.microbatches = pp_split, microbatches
        check_pipeline(config)

        self.spec = SCHEDULES[schedule]
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = torch.device(device)
        self.num_stages = self.pp_size * stages_per_rank
        self.stage_ranks = stage_to_rank(self.num_stages, self.pp_size, self.spec.placement)
        self.stage_indices = [s for s in range(self.num_stages) if self.stage_ranks[s] == self.pp_rank]
        layers = split_layers(pipeline_layers(model_config), self.num_stages, pp_split)
        self.stages = [build_stage_module(meta_model, layers[index], device=self.device, seed=seed,
                                          parallelize=parallelize_stage) for index in self.stage_indices]
        self.last_rank = self.stage_ranks[-1]
        # The tied embedding's ends, an encoder-decoder's embedding copy and a logit-bias position table (T5)
        # live on several stages.
        self.shared = SharedParameterGrads(self.stages, self.stage_indices, self.stage_ranks,
                                           shared_parameters(meta_model, layers), self.group)
        self._schedules: dict[tuple, object] = {}
        self.step_context: StepContext | None = None  # this step's, while train_step runs
        self.rows_per_microbatch = 0
        self.step_input_ids = torch.empty(0, dtype=torch.long)  # the batch's, while a step or an evaluation runs
        self.step_decoder_input_ids = torch.empty(0, dtype=torch.long)
        self._token_count = torch.ones((), device=self.device)
        self.last_step_seconds = 0.0
        # Optional instrumentation (``xscale bench parallel`` times the compute with it): set before the first
        # step, it wraps every compute action of the schedules (COMPUTE_ACTIONS of each stage, and the loss).
        self.wrap_compute: Callable[[Callable], Callable] | None = None
        # micro_batch_size is unused: the schedule cuts each batch into ``microbatches`` equal parts.
        super().__init__(self.stages[0], micro_batch_size=0, autocast_dtype=autocast_dtype, place=place)

    @classmethod
    def from_config(cls, config: Config, meta_model: Transformer, pp: DeviceMesh | dist.ProcessGroup,
                    device: torch.device | str = "cpu",
                    parallelize_stage: Callable[[Transformer], None] | None = None,
                    place: Placement = unplaced) -> PipelineEngine:
        parallel = config.parallel
        autocast = torch.bfloat16 if config.train.precision == "bf16" else None
        # ParallelDims.from_config has resolved an unset count against the batch; here only the schedule's floor.
        return cls(config.model, meta_model, pp, resolve_microbatches(config), parallel.pp_schedule,
                   parallel.pp_stages_per_rank, device, config.train.seed, parallel.pp_split, autocast,
                   parallelize_stage, place)

    @property
    def model_parts(self) -> list[nn.Module]:
        return list(self.stages)

    def microbatches_per_batch(self, rows: int) -> int:
        return self.microbatches

    @property
    def holds_first(self) -> bool:
        return is_first(self.stages[0])

    @property
    def holds_last(self) -> bool:
        return is_last(self.stages[-1])

    # ------------------------------------------------------------------ schedule
    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        last = self.stages[-1]
        return token_loss_sum(hidden, last.output, labels, last.kernels).float() / self._token_count

    def _schedule(self, batch: Batch, training: bool):
        rows = batch["input_ids"].shape[0]
        if rows % self.microbatches:
            raise ConfigError(f"a batch of {rows} sequences does not split into parallel.microbatches="
                              f"{self.microbatches}; use a batch that is a multiple of {self.microbatches}")
        # Stages learn their activation shapes on first use, so each input shape gets its own.
        decoder_shape = tuple(batch["decoder_input_ids"].shape[1:]) if "decoder_input_ids" in batch else ()
        key = (training, rows, *batch["input_ids"].shape[1:], decoder_shape)
        if key not in self._schedules:
            stages = [MicrobatchStage(module, index, self.num_stages, self.device, group=self.group,
                                             pause_statistics=self.routing_groups.paused)
                      for module, index in zip(self.stages, self.stage_indices)]
            loss_fn = self._loss
            for stage in stages:
                stage.engine = self
                if self.wrap_compute is not None:
                    for name in COMPUTE_ACTIONS:
                        setattr(stage, name, self.wrap_compute(getattr(stage, name)))
            if self.wrap_compute is not None:
                loss_fn = self.wrap_compute(loss_fn)
            kwargs = {"n_microbatches": self.microbatches, "loss_fn": loss_fn, "scale_grads": False}
            cls = self.spec.cls if training else (self.spec.eval_cls or self.spec.cls)
            self._schedules[key] = cls(stages[0], **kwargs) if self.spec.single_stage else cls(stages, **kwargs)
        return self._schedules[key]

    def _run(self, batch: Batch, training: bool) -> torch.Tensor:
        self._token_count = self.global_token_count(batch).clamp_min(1).to(self.device, torch.float32)
        schedule = self._schedule(batch, training)
        self.step_input_ids = batch["input_ids"]
        if self.stages[0].seq2seq and "decoder_input_ids" not in batch:
            raise ValueError("an encoder-decoder model needs decoder_input_ids in the batch")
        self.step_decoder_input_ids = batch.get("decoder_input_ids", torch.empty(0, dtype=torch.long))
        self.rows_per_microbatch = batch["input_ids"].shape[0] // self.microbatches
        args = (batch["input_ids"],) if self.holds_first else ()
        target = batch["labels"] if self.holds_last else None
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        with self._autocast():
            if training:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        self.last_step_seconds = time.perf_counter() - start
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:
            total += loss.detach().float()
        dist.broadcast(total, group=self.group, group_src=self.last_rank)
        return total.cpu()

    # ------------------------------------------------------------------ Engine
    def train_step(self, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
        """Forward + backward of every microbatch through the schedule; the global-batch mean token loss.
        ``context``: as :meth:`Engine.train_step`'s (each microbatch's is made by :class:`MicrobatchStage`)."""
        for stage in self.stages:
            stage.train()
        self.shared.begin()
        moe_loss_scale = self.routing_groups.begin_step(self.microbatches)
        begin_training_step(self.stages, self.microbatches * self.data_parallel_replicas)
        self.step_context = replace(context or StepContext(), moe_loss_scale=moe_loss_scale)
        try:
            total = self._run(batch, training=True)
        finally:
            self.step_context = None
        self.shared.finish()
        if self.distributed:
            self.data_parallel.after_backward()
        self.routing_groups.end_step()
        return self.reduce_loss(total)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        for stage in self.stages:
            stage.eval()
        return self.reduce_loss(self._run(batch, training=False))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage (each shared parameter counted once); clip when ``max_norm`` > 0."""
        uncounted = {id(param) for param in self.shared.uncounted}
        if self.distributed:
            return clip_gradients(self.data_parallel.gradient_pieces(uncounted=uncounted), max_norm)
        params = [p for p in self.parameters() if p.grad is not None]
        counted = [p.grad for p in params if id(p) not in uncounted]
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
        if hasattr(local, "full_tensor"):  # a DTensor norm (sharded gradients) reduces over its mesh first
            local = local.full_tensor()
        squared = local.float() ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Single-process keys (:mod:`~xscale.parallel.pipeline_checkpoint`): the model state of this rank's stages;
        the state of a copy under its source's name (``embedding.weight`` ...), held once per rank."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        custom = self.data_parallel.optimizer_state_dict(optimizer) if self.distributed else None
        if custom is not None:
            model_state, optimizer_state = get_model_state_dict(self._view()), custom
        else:
            model_state, optimizer_state = get_state_dict(self._view(), optimizer, options=STATE_DICT_OPTIONS)
        model_state, optimizer_state = drop_aliases(model_state), drop_aliases(optimizer_state)
        copies_to_sources(model_state, optimizer_state, *self._renamed_copies())
        state = {"model": model_state, "optimizer": optimizer_state}
        return state if self.expert_mesh is None else globalize_expert_state(state, self.expert_mesh)

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.expert_mesh is not None:
            state = localize_expert_state(state, self.model_parts)
        model_state, optimizer_state = sources_to_copies(state["model"], state["optimizer"], *self._renamed_copies())
        view = self._view()
        model_state = add_aliases(model_state, view)
        optimizer_state = add_aliases(optimizer_state, view, flat_optimizer=True)
        if self.distributed and self.data_parallel.optimizer_state_dict(optimizer) is not None:
            set_model_state_dict(view, model_state)
            self.data_parallel.load_optimizer_state_dict(optimizer, optimizer_state)
            return
        set_state_dict(view, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=STATE_DICT_OPTIONS)

    def _view(self) -> nn.Module:
        """This rank's stages under single-process names (:func:`merged_view`), shared modules aliased."""
        shared = {entry.name.rsplit(".", 1)[0] for entry in self.shared.shared} | shared_block_modules(self.stages)
        return merged_view(self.stages, shared)

    def _renamed_copies(self) -> tuple[dict[str, str], set[str]]:
        """The copies this rank holds under another name (-> their single-process name), and the names of its
        other parameters (canonical)."""
        copies = self.shared.renamed_copies()
        names = {canonical_name(name) for stage in self.stages for name, _ in stage.named_parameters()}
        return copies, names - set(copies)

