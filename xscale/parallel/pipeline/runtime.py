"""The pipeline schedule of one rank: its stages, and the forwards and backwards of a step run through them.

The contract is the trainer's step's (:mod:`xscale.train.step`): the loss summed on every pp rank and the
gradients left are the single-process model's on the whole batch. Each microbatch's loss is its token
cross-entropy SUM over the global count of labelled tokens, and the schedule is told not to rescale
(``scale_grads=False``), so gradients add up to the global mean.

Every stage runs the model's own forward (:mod:`~xscale.parallel.pipeline.stages`) with, as keywords, the
microbatch's :class:`~xscale.runtime.StepContext` (its dropout position, token ids and this rank's place in the
layout) and ``decoder_input_ids``, which the first decoder stage of an encoder-decoder model embeds (every pp rank
has the batch). Under tensor parallelism (each stage split over ``tp`` before it is initialised) what one stage
sends the next is a plain local tensor: the microbatch's full hidden states, or under sequence parallelism this tp
rank's sequence shard (B/m, T/tp, D), always to the same tp rank of the next stage, so PipelineStage infers the
shapes from the first microbatch.

``torch.distributed.pipelining`` is imported when the first schedule is built (:func:`torch_stage_class`): it loads
``torch._dynamo``, seconds of the start-up of every run, most of which have no pipeline.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.config.schema import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from xscale.models.init import canonical_name
from xscale.models.transformer import Transformer
from xscale.parallel.expert.routing_groups import RoutingGroups
from xscale.parallel.loss import token_loss_sum
from xscale.parallel.model import Batch, Placement, unplaced
from xscale.parallel.pipeline.checkpoint import (
    add_aliases,
    copies_to_sources,
    drop_aliases,
    merged_view,
    sources_to_copies,
)
from xscale.parallel.pipeline.cost import stage_layers
from xscale.parallel.pipeline.schedules import SCHEDULES, check_pipeline, resolve_microbatches
from xscale.parallel.pipeline.shared import SharedParameterGrads, shared_block_modules, shared_parameters
from xscale.parallel.pipeline.stages import (
    build_stage_module,
    is_first,
    stage_to_rank,
    whole_backward,
)
from xscale.parallel.pipeline.vocabulary import (
    VocabularyShard,
    vocabulary_shard,
    vocabulary_stage_count,
)
from xscale.parallel.pipeline.vocabulary_state import VocabularyRows
from xscale.runtime import StepContext


class QuietMetadataStage:
    """Put on torch's ``PipelineStage`` (:func:`torch_stage_class`): a stage whose metadata-inference forward records
    no MoE routing statistics and leaves the stage's buffers as they were (routing attention's centroids and pending
    statistics): before its first step torch runs each stage once on the first microbatch (later stages: on
    uninitialised placeholders)."""

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


class MicrobatchStage(QuietMetadataStage):
    """Put on torch's ``PipelineStage`` (:func:`torch_stage_class`): a stage whose forward of microbatch k, whatever
    order the schedule runs microbatches in, gets that microbatch's context (dropout masks of its rows in the global
    batch, :mod:`xscale.models.dropout`; its token ids for hash routing) and ``decoder_input_ids`` as keywords of the
    model's forward."""

    _chunk = 0

    def __init__(self, *args, schedule: PipelineSchedule,
                 wrap_compute: Callable[[Callable], Callable] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.wrap_compute = wrap_compute  # instrumentation around each compute action (forward, backward, backward weight)

    def _compute(self, action: Callable, *args, **kwargs):
        return (action if self.wrap_compute is None else self.wrap_compute(action))(*args, **kwargs)

    def _chunk_kwargs(self, index: int) -> dict:
        schedule = self.schedule
        rows = schedule.rows_per_microbatch

        def part(ids: torch.Tensor) -> torch.Tensor | None:
            return ids[index * rows:(index + 1) * rows] if ids.numel() else None

        if isinstance(self.submod, VocabularyShard):
            return {"labels": part(schedule.step_labels)}
        context = schedule.place(schedule.step_context.microbatch(index, rows))
        return {"decoder_input_ids": part(schedule.step_decoder_input_ids),
                "context": context.with_token_ids(part(schedule.step_input_ids)), "project": False}

    def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None, has_backward: bool = False):
        # torch's shape inference runs the first microbatch
        return super()._prepare_forward_infra(num_microbatches, args, {**(kwargs or {}), **self._chunk_kwargs(0)},
                                              has_backward=has_backward)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._chunk = fwd_chunk_id
        return self._compute(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._compute(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._compute(super().backward_weight_one_chunk, *args, **kwargs)

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


@functools.cache
def torch_stage_class() -> type:
    """:class:`MicrobatchStage` on torch's ``PipelineStage``, made when the first schedule is built (module docstring)."""
    from torch.distributed.pipelining import PipelineStage

    return type("MicrobatchStage", (MicrobatchStage, PipelineStage), {})


FORWARD_ACTIONS = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")  # torch's _ComputationType values


def keep_forward_actions(schedule) -> None:
    """Drop every action of a multi-stage ``schedule`` but the forwards and their sends and receives
    (:attr:`~xscale.parallel.pipeline.schedules.ScheduleSpec.eval_forward_only`)."""
    schedule.pipeline_order_with_comms = {
        rank: [action for action in actions if action.computation_type.value in FORWARD_ACTIONS]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }


def pp_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(pp, DeviceMesh):
        if pp.ndim == 1:
            return pp.get_group()
        if "pp" not in (pp.mesh_dim_names or ()):
            raise ConfigError(f"pipeline parallelism needs a mesh dimension named 'pp'; this mesh has "
                              f"{pp.mesh_dim_names}")
        return pp["pp"].get_group()
    return pp


class PipelineSchedule:
    """This rank's stages over the ``pp`` group, and :meth:`step` / :meth:`evaluate` running a batch through
    them. Every pp rank calls them with the same batch (this data-parallel rank's share): the first stage reads
    ``input_ids``, the last ``labels``. Data parallelism wraps :attr:`stages` from outside; this class does none."""

    def __init__(self, config: Config, meta_model: Transformer, pp: DeviceMesh | dist.ProcessGroup, *,
                 device: torch.device | str = "cpu", place: Placement = unplaced,
                 parallelize_stage: Callable[[Transformer], None] | None = None) -> None:
        self.group = pp_group(pp)
        self.pp_size, self.pp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.pp_size < 2:
            raise ConfigError(f"a pipeline needs a pp group of 2 or more ranks, got {self.pp_size}")
        parallel = config.parallel
        check_pipeline(config)
        self.spec = SCHEDULES[parallel.pp_schedule]
        # resolve_dims resolves an unset count against the batch (the trainer passes that count); here, unset,
        # only the schedule's floor.
        self.microbatches = resolve_microbatches(config)
        self.device, self.place = torch.device(device), place
        self.num_stages = self.pp_size * parallel.pp_stages_per_rank
        self.stage_ranks = stage_to_rank(self.num_stages, self.pp_size, self.spec.placement)
        self.stage_indices = [s for s in range(self.num_stages) if self.stage_ranks[s] == self.pp_rank]
        layers = stage_layers(config, self.num_stages)
        vocabulary = vocabulary_stage_count(parallel)
        self.vocabulary_parallel = vocabulary > 0
        self.stages = [build_stage_module(meta_model, layers[index], device=self.device, seed=config.train.seed,
                                          parallelize=parallelize_stage,
                                          vocabulary=vocabulary_shard(index, self.stage_ranks, vocabulary),
                                          vocabulary_parallel=self.vocabulary_parallel)
                       for index in self.stage_indices]
        self.last_rank = self.stage_ranks[-1]
        # The tied embedding's ends, an encoder-decoder's embedding and a logit-bias position table (T5) live on
        # several stages.
        shared = shared_parameters(meta_model, layers, vocabulary, self.stage_ranks)
        self.shared = SharedParameterGrads(self.stages, self.stage_indices, self.stage_ranks, shared, self.group)
        self.vocabulary_rows = self._vocabulary_rows(pp, shared, vocabulary) if self.vocabulary_parallel else None
        self._schedules: dict[tuple, object] = {}
        self.step_context = StepContext()  # the running step's (each microbatch's is derived from it)
        self.rows_per_microbatch = 0
        self.step_input_ids = torch.empty(0, dtype=torch.long)  # the batch's, while a step or an evaluation runs
        self.step_decoder_input_ids = torch.empty(0, dtype=torch.long)
        self.step_labels = torch.empty(0, dtype=torch.long)  # what vocabulary stages read (each microbatch's rows)
        self._token_count = torch.ones((), device=self.device)
        self.last_step_seconds = 0.0
        # Optional instrumentation (``xscale bench parallel`` times the compute with it): set before the first
        # step, it wraps every compute action of the schedules (each stage's forward and backward chunks, and the loss).
        self.wrap_compute: Callable[[Callable], Callable] | None = None

    @classmethod
    def for_model(cls, model_config: ModelConfig, meta_model: Transformer, pp: DeviceMesh | dist.ProcessGroup,
                  microbatches: int, schedule: str = "1f1b", stages_per_rank: int = 1, seed: int = 0,
                  pp_split: list[int] | None = None, vocab_parallel: bool = False, **kwargs) -> PipelineSchedule:
        """A pipeline of ``model_config`` over the whole ``pp`` group, settings given one by one."""
        parallel = ParallelConfig(pp=dist.get_world_size(pp_group(pp)), pp_schedule=schedule,
                                  pp_stages_per_rank=stages_per_rank, pp_split=pp_split, microbatches=microbatches,
                                  pp_vocab_parallel=vocab_parallel)
        config = Config(model=model_config, parallel=parallel, train=TrainConfig(seed=seed))
        return cls(config, meta_model, pp, **kwargs)

    def _vocabulary_rows(self, pp: DeviceMesh | dist.ProcessGroup, shared: list,
                         vocabulary: int) -> VocabularyRows:
        """How this rank's vocabulary stage appears in checkpoints (:mod:`~xscale.parallel.pipeline.vocabulary_state`)."""
        if isinstance(pp, DeviceMesh):
            mesh = pp if pp.ndim == 1 else pp["pp"]
        else:
            mesh = DeviceMesh.from_group(pp, self.device.type)
        shard = next(stage for stage in self.stages if isinstance(stage, VocabularyShard))
        holders = [stage for stage in self.stages if getattr(stage, "embedding", None) is not None]
        tied = [entry for entry in shared if entry.rows]
        whole_ranks = sorted({self.stage_ranks[s] for s in tied[0].stages if s not in tied[0].rows}) if tied else []
        return VocabularyRows(shard, mesh, lambda: holders[0].embedding.weight if holders else None, whole_ranks)

    @property
    def holds_first(self) -> bool:
        return is_first(self.stages[0])

    @property
    def holds_last(self) -> bool:
        return self.stage_indices[-1] == self.num_stages - 1

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.vocabulary_parallel:  # the last vocabulary stage returned the token loss sum
            return hidden.float() / self._token_count
        last = self.stages[-1]
        return token_loss_sum(hidden, last.output, labels, last.kernels,
                              gradient_in_forward=self.spec.loss_gradient_in_forward).float() / self._token_count

    def _schedule(self, batch: Batch, training: bool, routing_groups: RoutingGroups):
        rows = batch["input_ids"].shape[0]
        if rows % self.microbatches:
            raise ConfigError(f"a batch of {rows} sequences does not split into parallel.microbatches="
                              f"{self.microbatches}; use a batch that is a multiple of {self.microbatches}")
        # Stages learn their activation shapes on first use, so each input shape gets its own.
        decoder_shape = tuple(batch["decoder_input_ids"].shape[1:]) if "decoder_input_ids" in batch else ()
        key = (training, rows, *batch["input_ids"].shape[1:], decoder_shape)
        if key not in self._schedules:
            stages = [torch_stage_class()(module, index, self.num_stages, self.device, group=self.group,
                                          pause_statistics=routing_groups.paused, schedule=self,
                                          wrap_compute=self.wrap_compute)
                      for module, index in zip(self.stages, self.stage_indices)]
            loss_fn = self._loss
            if self.wrap_compute is not None:
                loss_fn = self.wrap_compute(loss_fn)
            kwargs = {"n_microbatches": self.microbatches, "loss_fn": loss_fn, "scale_grads": False}
            cls = self.spec.cls  # imports torch.distributed.pipelining (module docstring)
            schedule = cls(stages[0], **kwargs) if self.spec.single_stage else cls(stages, **kwargs)
            if not training and self.spec.eval_forward_only:
                keep_forward_actions(schedule)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _run(self, batch: Batch, tokens: torch.Tensor, training: bool, routing_groups: RoutingGroups) -> torch.Tensor:
        self._token_count = tokens.to(self.device, torch.float32)
        schedule = self._schedule(batch, training, routing_groups)
        if self.stages[0].seq2seq and "decoder_input_ids" not in batch:
            raise ValueError("an encoder-decoder model needs decoder_input_ids in the batch")
        self.step_input_ids = batch["input_ids"]
        self.step_decoder_input_ids = batch.get("decoder_input_ids", torch.empty(0, dtype=torch.long))
        self.step_labels = batch["labels"] if self.vocabulary_parallel else torch.empty(0, dtype=torch.long)
        self.rows_per_microbatch = batch["input_ids"].shape[0] // self.microbatches
        args = (batch["input_ids"],) if self.holds_first else ()
        target = batch["labels"] if self.holds_last else None
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        if training:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        self.last_step_seconds = time.perf_counter() - start
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:
            total += loss.detach().float()
        dist.broadcast(total, group=self.group, group_src=self.last_rank)
        return total

    def step(self, batch: Batch, context: StepContext, tokens: torch.Tensor,
             routing_groups: RoutingGroups) -> torch.Tensor:
        """Forward and backward of every microbatch through the schedule (``tokens``: the global count of labelled
        tokens); returns the sum of the microbatches' losses, the same on every pp rank."""
        self.shared.begin()
        self.step_context = context
        try:
            total = self._run(batch, tokens, training=True, routing_groups=routing_groups)
        finally:
            self.step_context = StepContext()
        self.shared.finish()
        return total

    @torch.no_grad()
    def evaluate(self, batch: Batch, tokens: torch.Tensor, routing_groups: RoutingGroups) -> torch.Tensor:
        return self._run(batch, tokens, training=False, routing_groups=routing_groups)

    # ------------------------------------------------------------------ checkpoint names
    def state_view(self) -> nn.Module:
        """This rank's stages under single-process names (:func:`merged_view`), shared modules aliased."""
        shared = {entry.name.rsplit(".", 1)[0] for entry in self.shared.shared} | shared_block_modules(self.stages)
        return merged_view(self.stages, shared)

    def _renamed_copies(self) -> tuple[dict[str, str], set[str]]:
        """The copies this rank holds under another name (-> their single-process name), and the names of its
        other parameters (canonical)."""
        copies = self.shared.renamed_copies()
        names = {canonical_name(name) for stage in self.stages for name, _ in stage.named_parameters()}
        return copies, names - set(copies)

    def to_single_process_names(self, state: dict) -> dict:
        """The state of :meth:`state_view` with single-process keys (:mod:`~xscale.parallel.pipeline.checkpoint`):
        the second copies of a module two stages of this rank hold dropped, a copy under another name saved under
        its source's name."""
        model_state, optimizer_state = drop_aliases(state["model"]), drop_aliases(state["optimizer"])
        copies_to_sources(model_state, optimizer_state, *self._renamed_copies())
        state = {"model": model_state, "optimizer": optimizer_state}
        return state if self.vocabulary_rows is None else self.vocabulary_rows.globalize(state)

    def from_single_process_names(self, state: dict, view: nn.Module) -> dict:
        """The inverse of :meth:`to_single_process_names` for ``view``."""
        if self.vocabulary_rows is not None:
            state = self.vocabulary_rows.localize(state)
        model_state, optimizer_state = sources_to_copies(state["model"], state["optimizer"], *self._renamed_copies())
        return {"model": add_aliases(model_state, view),
                "optimizer": add_aliases(optimizer_state, view, flat_optimizer=True)}
