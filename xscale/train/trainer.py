"""The training loop. It knows neither the model variant nor the parallel layout.

Each step: the sampler names the global batch, this data-parallel rank loads its slice, the step runs its forward
and backward (:func:`~xscale.train.step.forward_backward_step`: microbatches, or the pipeline schedule the layout
brings), the trainer clips, steps the optimizer and the schedule, logs, evaluates and saves.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from xscale.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    rng_state,
    set_rng_state,
    step_dir_name,
)
from xscale.checkpoint.elastic import elastic_micro_batch
from xscale.checkpoint.init_sources import WEIGHTS_ONLY, fill_from_source, init_source_prefix
from xscale.checkpoint.memory_snapshot import fill_state, newer_than_disk, open_snapshots, plain_leaves
from xscale.config.schema import Config, ConfigError, TrainConfig
from xscale.data import (
    GlobalSampler,
    HasSources,
    SourceTokenCounter,
    build_datasets,
    collate,
    run_tokenizer_file,
)
from xscale.data.labeled import LABELS_META_KEY
from xscale.data.load_tokenizer import META_KEY as TOKENIZER_META_KEY
from xscale.data.load_tokenizer import checkpoint_tokenizer_name
from xscale.data.prefetch import Prefetcher
from xscale.launcher.cpu_allocator import keep_freed_memory
from xscale.launcher.env import World, detect_world, init_distributed, local_device
from xscale.launcher.parent_death import exit_with_launcher
from xscale.launcher.preemption import PreemptionHandler
from xscale.models.attention.core import unused_attention_dropout
from xscale.models.batch_statistics import statistics_over_the_microbatch
from xscale.models.float8 import float8_linears
from xscale.models.init import canonical_name
from xscale.models.parameters import count_parameters
from xscale.models.segment_memory import SegmentMemory
from xscale.models.stacks import label_loss_positions
from xscale.parallel.checks import resolve_layout
from xscale.parallel.loss import positions_read
from xscale.parallel.parallelize import parallelize
from xscale.runtime import StepContext
from xscale.runtime.hooks import ReportsLayerMetrics
from xscale.train.bf16_support import bf16_warning
from xscale.train.health import TrainingHealth
from xscale.train.memory_reshard import MemoryRows
from xscale.train.metrics import MetricsLogger, flops_per_token, peak_memory_bytes
from xscale.train.peak_flops import MfuDenominator
from xscale.train.profiling import StepProfiler
from xscale.train.recurrence import (
    MEMORY_FILES,
    MEMORY_META_KEY,
    build_sampler,
    load_memory,
    memory_meta,
    stream_evaluation,
)
from xscale.train.run_lock import RunLock, RunLocked
from xscale.train.schedule import lr_factor, saved_schedule, schedule_change, schedule_parameters
from xscale.train.spikes import LossSpikeDetector
from xscale.train.step import (
    clip_gradient_norm,
    evaluation_loss,
    evaluation_predictions,
    exit_path_refusal,
    forward_backward_step,
    model_optimizer,
    optimizer_step,
)
from xscale.train.watchdog import StepWatchdog

LOCK_REFRESH_S = 60.0
AUTO_EVALUATIONS = 10  # evaluations over a run that leaves train.eval_every unset


def evaluation_interval(train: TrainConfig, eval_examples: int) -> int:
    """Steps between evaluations: ``train.eval_every``, or unset, about :data:`AUTO_EVALUATIONS` over the run when
    there is an eval split (never more often than every 10 steps or than the log); 0: none."""
    if train.eval_every is not None:
        return train.eval_every
    return max(10, train.log_every, train.steps // AUTO_EVALUATIONS) if eval_examples else 0


class NonFiniteTraining(RuntimeError):
    """The loss or gradient norm became NaN/Inf and train.on_nonfinite says to stop; the message says what to do."""


class Trainer:
    def __init__(self, config: Config, train_dataset: Any = None, eval_dataset: Any = None) -> None:
        world = detect_world()
        # The layout is validated against the launched world before any process group exists; the run reads the
        # resolved copy (an unset parallel.microbatches as its count), the caller's config is left as given.
        self.dims, config = resolve_layout(config, world.world_size)
        self.config = config
        train = config.train
        if world.world_size > 1:
            exit_with_launcher()
            init_distributed(config.parallel.backend, timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
        self.rank, self.world_size = world.rank, world.world_size
        # First: a job that will be refused writes nothing into the directory (data cache, tokenizer) and waits for
        # no dataset or model to be built.
        self.lock = self._lock_output_dir(Path(train.output_dir))
        try:
            self._build(world, train_dataset, eval_dataset)
        except BaseException:
            self.lock.release()
            raise

    def _build(self, world: World, train_dataset: Any, eval_dataset: Any) -> None:
        """Everything but the lock: the device, data, mesh, model, optimizer, checkpointer and loggers."""
        config, train = self.config, self.config.train
        self.device = local_device(world)
        if self.device.type != "cpu":
            torch.accelerator.set_device_index(self.device.index)
        else:
            keep_freed_memory()  # activations and gradients re-allocated every step stop page-faulting
        torch.manual_seed(train.seed)
        if train_dataset is None:
            train_dataset, eval_dataset = build_datasets(config)[:2]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.label_names = self._classes(train_dataset)

        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        self.dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        self.dp_size = self.dims.dp
        self.local_batch_size = train.global_batch_size // self.dp_size
        self.model = parallelize(config, self.dims, self.mesh, self.device)
        count = count_parameters(config)
        self.num_params = count.total
        self.optimizer = model_optimizer(self.model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, train))
        self.sampler = build_sampler(config, train_dataset)
        # Transformer-XL: this rank's rows' remembered layer inputs, carried from step to step (xscale.train.recurrence).
        self.memory = (SegmentMemory(config.model.segment_memory, config.model.compressed_memory)
                       if config.model.segment_memory else None)
        # The next step's batch loads while this step computes (the sampler's state only moves in next_batch).
        self.prefetcher = Prefetcher(lambda step: self._load(self.train_dataset, self.sampler.step_indices(step)))
        # Tokens trained on per source of a blend (data/tokens/<name>), continued across resumes.
        self.source_tokens = (SourceTokenCounter(train_dataset.source_names, train.seq_len)
                              if isinstance(train_dataset, HasSources) else None)
        self.step = 0
        self.parent: str | None = None  # the checkpoint this run resumed from (its lineage, in each meta.json)
        output_dir = Path(train.output_dir)
        # Every checkpoint carries the tokenizer (for export and generation), named in its meta.json.
        tokenizer = run_tokenizer_file(config)
        self.tokenizer_in_checkpoint = checkpoint_tokenizer_name(tokenizer) if tokenizer else None
        self.checkpointer = Checkpointer(config.checkpoint.dir or output_dir / "checkpoints",
                                         keep=config.checkpoint.keep, async_save=config.checkpoint.async_save,
                                         verify=config.checkpoint.verify,
                                         carry={self.tokenizer_in_checkpoint: tokenizer} if tokenizer else {})
        self.snapshots = open_snapshots(config, self.dims.describe(), self.checkpointer.directory, self.rank,
                                        self.world_size, world.local_world_size)
        self.metrics = MetricsLogger(output_dir, enabled=self.rank == 0, total_steps=train.steps,
                                     log_every=train.log_every, loggers=train.logger_names(),
                                     progress=train.progress, config=config.to_dict(),
                                     loss_unit="nats/example" if self.label_names is not None else "nats/token")
        self.profiler = StepProfiler(output_dir, rank=self.rank, start=train.profile_start, steps=train.profile_steps,
                                     device=self.device)
        self.flops_per_token = flops_per_token(config.model, train.seq_len, count.matmul_per_token)
        self.peak_flops: MfuDenominator | None = None  # rank 0's, set as the run starts
        # SIGUSR1/SIGTERM: save and requeue; SIGINT (Ctrl-C): save and exit 130 (xscale/commands/train.py)
        self.preemption = PreemptionHandler(signals=(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT))
        self.stop_requested = False
        self.skipped_steps = self.skipped_in_a_row = 0  # updates dropped for a non-finite loss or gradient norm
        self.spikes = LossSpikeDetector(train.spike_factor, train.spike_window, announce=self.rank == 0)
        self.health = TrainingHealth(train.health_check, train.health_window, train.health_loss_factor,
                                     train.health_grad_collapse)

    def _classes(self, train_dataset: Any) -> list[str] | None:
        """train.task=classify: the data's labels, whose count sets model.num_classes (None for language models)."""
        if self.config.train.task != "classify":
            return None
        names = list(train_dataset.label_names)
        model = self.config.model
        if model.num_classes and model.num_classes != len(names):
            raise ConfigError(f"model.num_classes={model.num_classes} but the data holds {len(names)} labels; "
                              "leave model.num_classes out (0) to take the data's")
        model.num_classes = len(names)
        return names

    def _lock_output_dir(self, output_dir: Path) -> RunLock:
        """Rank 0 takes the output directory's lock; every rank raises the same RunLocked if another job holds it."""
        lock, refusal = RunLock(output_dir), None
        if self.rank == 0:
            try:
                lock.acquire()
            except RunLocked as error:
                refusal = str(error)
        if self.world_size > 1:
            shared = [refusal]
            torch.distributed.broadcast_object_list(shared, src=0)
            refusal = shared[0]
        if refusal is not None:
            raise RunLocked(refusal)
        return lock

    def _watchdog(self) -> StepWatchdog | None:
        train = self.config.train
        if not train.watchdog:
            return None
        store = torch.distributed.distributed_c10d._get_default_store() if self.world_size > 1 else None
        return StepWatchdog(train.step_timeout_s, first_step_timeout_s=train.first_step_timeout_s, rank=self.rank,
                            world_size=self.world_size, store=store)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        return self.model.state_dict(self.optimizer)

    def _meta(self) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]] | None]:
        """What a checkpoint holds beside the model and optimizer: its meta.json and this rank's own tensors."""
        meta = {"config": self.config.to_dict(), "sampler": self.sampler.state_dict(),
                "world_size": self.world_size, "layout": self.dims.describe(), "num_params": self.num_params,
                "data_parallel": self.dp_size, "micro_batch_size": self.model.micro_batch_size,
                "parent": self.parent, "schedule": schedule_parameters(self.config.train),
                "loggers": self.metrics.state_dict()}
        if self.source_tokens is not None:
            meta["data_tokens"] = self.source_tokens.state_dict()
        if self.label_names is not None:
            meta[LABELS_META_KEY] = self.label_names
        if self.tokenizer_in_checkpoint:
            meta[TOKENIZER_META_KEY] = self.tokenizer_in_checkpoint
        per_rank = None
        if self.memory is not None:
            meta[MEMORY_META_KEY] = self._memory_meta()
            per_rank = {MEMORY_FILES: self.memory.state_dict()}
        return meta, per_rank

    def save(self) -> None:
        self.model.data_parallel.settle()  # parameters still arriving from the last step's all-gather
        meta, per_rank = self._meta()
        self.metrics.flush()  # the curve up to a checkpoint is on disk before it
        self.checkpointer.protected = self.health.keep()
        if self.health.problem is not None and not self.health.announced:
            self.health.announced = True
            kept = (f"{self.health.keep()}, the last checkpoint confirmed healthy, is kept from rotation"
                    if self.health.keep() else "no checkpoint of this run was confirmed healthy yet")
            self._announce(f"xscale: training looks unhealthy since step {self.health.since}: {self.health.problem}; "
                           f"{kept}")
        self.checkpointer.save(self.step, self.state(), meta, per_rank)
        self.health.saved(self.step, self.checkpointer.directory / step_dir_name(self.step))

    def take_snapshot(self) -> None:
        """checkpoint.memory_every: this rank's state into host memory and its peer's (collective)."""
        self.model.data_parallel.settle()
        meta, per_rank = self._meta()
        self.snapshots.take(self.step, {"meta": json.dumps({**meta, "step": self.step}), "state": plain_leaves(self.state()),
                                        "rng": rng_state(), "per_rank": per_rank or {}})

    def _memory_meta(self) -> dict[str, Any]:
        return memory_meta(self.config, self.dims.describe(), self.world_size, self.local_batch_size,
                           self.model.micro_batch_size)

    def resume(self) -> bool:
        """Load the checkpoint named by checkpoint.resume (auto: the newest that verifies, if any); with none to resume, start from
        checkpoint.init_from's weights when it names some."""
        self.model.data_parallel.settle()
        choice = self.config.checkpoint.resume
        if self.snapshots is not None and choice != "auto":
            self.snapshots.remove()  # another run's state: it is never resumed
        elif self.snapshots is not None and self._resume_from_memory():
            return True
        path = None if choice == "none" else self.checkpointer.newest_intact() if choice == "auto" else Path(choice)
        if path is None:
            self.initialize_from()
            return False
        if not path.exists():
            raise CheckpointError(f"checkpoint.resume={choice}: {path} does not exist")
        state = self.state()
        if Checkpointer.read_meta(path, verify="none").get(WEIGHTS_ONLY):
            self.checkpointer.load(path, {"model": state["model"]})  # the optimizer, schedule and data start fresh
            self.model.load_state_dict(state, self.optimizer)
            self._announce(f"started from the weights of {path}")
            self.parent = str(path)
            return True
        meta = self.checkpointer.load(path, state)
        self.model.load_state_dict(state, self.optimizer)
        self._continue_from(meta, path)
        return True

    def _resume_from_memory(self) -> bool:
        """checkpoint.resume=auto with memory snapshots: resume the newest step every rank has in memory (its own
        or its peer's copy) when it is newer than the newest intact disk checkpoint; one line says which and why."""
        agreement = self.snapshots.agree()
        newer, line = newer_than_disk(agreement, self.checkpointer)
        if not newer:
            if line:
                self._announce(f"xscale: {line}; resuming from disk")
            return False
        payload = self.snapshots.fetch(agreement)
        state = self.state()
        fill_state(state, payload["state"])
        set_rng_state(payload["rng"])
        self.model.load_state_dict(state, self.optimizer)
        meta = json.loads(payload["meta"])
        if self.memory is not None:
            self.memory.load_state_dict(payload["per_rank"][MEMORY_FILES], self.device)
        self._continue_from(meta, None, line)
        return True

    def _continue_from(self, meta: dict[str, Any], path: Path | None, source: str = "") -> None:
        """After the model and optimizer were loaded from checkpoint ``path`` (or a memory snapshot, ``source``):
        the step, data position, schedule and logs where they were."""
        self.step = int(meta["step"])
        train = self.config.train
        elastic = elastic_micro_batch(meta, train.global_batch_size, self.dp_size, train.micro_batch_size,
                                      statistics_over_the_microbatch(self.config.model))
        if elastic is not None and self.model.pipeline is None:  # a pipeline's microbatches are its own setting
            self.model.micro_batch_size = elastic[0]
            self._announce(elastic[1])
        try:
            self.sampler.load_state_dict(meta["sampler"])
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from error
        if self.memory is not None and path is not None:
            rows = MemoryRows.of_rank(self.dp_rank, self.dp_size, self.local_batch_size,
                                      self.model.microbatches_per_batch(self.local_batch_size))
            if regrouped := load_memory(self.memory, path, meta, self._memory_meta(), rows, self.device):
                self._announce(regrouped)
        if self.source_tokens is not None:
            self.source_tokens.load_state_dict(meta.get("data_tokens", {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, self.config.train), last_epoch=self.step - 1)
        self.parent = str(path) if path is not None else meta.get("parent")
        if path is not None:
            self.health.saved(self.step, path)  # confirmed by the first healthy step
        self.metrics.load_state_dict(meta.get("loggers", {}))
        abandoned = self.checkpointer.set_aside_later_steps(path) if path is not None else None
        self._announce(f"resumed from {path or source} at step {self.step}")
        if warning := schedule_change(saved_schedule(meta), self.config.train, self.step):
            self._announce(warning)
        if abandoned is not None:
            self._announce(f"rolled back: the checkpoints after step {self.step} were moved to {abandoned} (kept, not "
                           "deleted)")

    def initialize_from(self) -> None:
        """checkpoint.init_from=hf:DIR: copy a Hugging Face model's weights into this rank's part of the model (each
        tensor converted whole, then sliced to the rank's shard), through the state dict a checkpoint loads into
        (the source is registered by its layer: :mod:`xscale.checkpoint.init_sources`)."""
        source = self.config.checkpoint.init_from
        if init_source_prefix(source) is None:
            return
        state = self.state()
        fill_from_source(source, state["model"], self.config.model)
        self.model.load_state_dict(state, self.optimizer)
        self.parent = source
        self._announce(f"initialised from {source}")

    def _announce(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def layer_metrics(self) -> dict[str, float]:
        """Per-layer statistics of every layer of the model (rank 0 logs them; later pipeline stages send theirs)."""
        metrics: dict[str, float] = {}
        for module in self.model.parts:
            metrics.update(_collect_layer_metrics(module, self.model.routing_groups.layer_summary))
        if self.dims.pp > 1:
            stages: list[dict[str, float] | None] = [None] * self.dims.pp
            torch.distributed.all_gather_object(stages, metrics, group=self.mesh["pp"].get_group())
            metrics = {key: value for stage in stages for key, value in stage.items()}
        return metrics

    # ------------------------------------------------------------------ data
    def _load(self, dataset: Any, indices: list[int]) -> dict[str, torch.Tensor]:
        microbatches = self.model.microbatches_per_batch(len(indices) // self.dp_size)
        local = GlobalSampler.shard(indices, self.dp_rank, self.dp_size, microbatches)
        batch = label_loss_positions(self.config.model, collate([dataset[i] for i in local]))
        return {key: value.to(self.device) for key, value in batch.items()}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This step's batch (loaded ahead during the previous step when it ran in order); starts the next one's."""
        indices = self.sampler.batch_indices(self.step)
        if self.source_tokens is not None:
            self.source_tokens.count(self.train_dataset.sources_of(indices))
        return self.prefetcher.get(self.step, prefetch_next=self.step + 1 < self.config.train.steps)

    def evaluate(self) -> dict[str, float]:
        """eval/loss over up to train.eval_batches whole batches of the eval split, and eval/accuracy for a
        classifier (NaN without an eval split); with model.stack=early_exit, eval/accuracy_full_depth,
        eval/mean_exit_layer and eval/exit_compute_fraction too (eval/accuracy being the early exits')."""
        self.model.data_parallel.settle()
        classify = self.label_names is not None
        exits = classify and self.config.model.stack.kind == "early_exit"
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            return {"eval/loss": float("nan"), **({"eval/accuracy": float("nan")} if classify else {})}
        size = self.config.train.global_batch_size
        losses, predictions = [], []
        for start in range(0, min(len(self.eval_dataset), size * self.config.train.eval_batches), size):
            indices = list(range(start, min(start + size, len(self.eval_dataset))))
            if len(indices) < size:
                break
            batch = self._load(self.eval_dataset, indices)
            losses.append(float(evaluation_loss(self.model, batch)))
            if classify:
                predictions.append(evaluation_predictions(self.model, batch, exits))
        scalars = {"eval/loss": sum(losses) / len(losses) if losses else float("nan")}
        for name in ("accuracy_full_depth", "mean_exit_layer", "exit_compute_fraction") if exits and predictions else ():
            scalars[f"eval/{name}"] = sum(metrics[name] for metrics in predictions) / len(predictions)
        if self.memory is not None:
            scalars.update(stream_evaluation(self.model, lambda rows: self._load(self.eval_dataset, rows),
                                             len(self.eval_dataset), size, self.config.train.eval_batches,
                                             self.memory.length, self.step_context(), self.memory.compressed_length))
        if classify:
            scalars["eval/accuracy"] = (sum(metrics["accuracy"] for metrics in predictions) / len(predictions)
                                        if predictions else float("nan"))
        return scalars

    def step_context(self) -> StepContext:
        """Where this rank's batch sits in the step's global batch (its microbatches as :meth:`_load` reads them):
        dropout masks follow the step and each sample's place, not the layout."""
        micro = self.local_batch_size // self.model.microbatches_per_batch(self.local_batch_size)
        return StepContext(self.config.train.seed, self.step, first_sample=self.dp_rank * micro,
                           microbatch_stride=self.dp_size * micro)

    def _carry_memory(self, context: StepContext) -> StepContext:
        """The step's context with the segment memory (dropped first when the streams restart at this step)."""
        if self.memory is None:
            return context
        if self.sampler.starts_streams(self.step):
            self.memory.reset()
        return context.with_segment_memory(self.memory)

    # ------------------------------------------------------------------ loop
    def train_step(self) -> dict[str, float]:
        """One optimizer step; its time counts waiting for the batch (perf/data_seconds of it)."""
        start = time.perf_counter()
        batch = self.next_batch()
        data_seconds = time.perf_counter() - start
        tokens = positions_read(batch, self.config.train.seq_len) * self.dp_size
        loss = forward_backward_step(self.model, batch, self._carry_memory(self.step_context()))
        if self.memory is not None:
            self.memory.advance()
        grad_norm = clip_gradient_norm(self.model, self.config.train.grad_clip)
        if math.isfinite(float(loss)) and math.isfinite(float(grad_norm)):  # both global: every rank agrees
            optimizer_step(self.model, self.optimizer)
            self.skipped_in_a_row = 0
        else:
            self._drop_nonfinite_update(float(loss), float(grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        self.health.observe(self.step, float(loss), float(grad_norm))
        elapsed = time.perf_counter() - start
        tokens_per_second = tokens / elapsed
        scalars = {"train/loss": float(loss), "train/lr": lr, "train/grad_norm": float(grad_norm),
                   "train/skipped_steps": self.skipped_steps,
                   "train/loss_spike": self.spikes.observe(self.step, float(loss),
                                                           lambda: self.sampler.batch_indices(self.step - 1)),
                   "perf/tokens_per_second": tokens_per_second, "perf/step_seconds": elapsed,
                   "perf/data_seconds": data_seconds,
                   "perf/memory_gb": peak_memory_bytes(self.device) / 2**30}
        if self.source_tokens is not None:
            scalars.update(self.source_tokens.scalars())
        if self.peak_flops:
            scalars["perf/mfu"] = self.peak_flops.mfu(tokens_per_second * self.flops_per_token / self.world_size)
        return scalars

    def _drop_nonfinite_update(self, loss: float, grad_norm: float) -> None:
        """A NaN/Inf loss or gradient norm: the update is never applied, so no checkpoint holds it. ``stop`` ends
        the run; ``skip`` drops this step's gradients (the step and its batch still count) until too many in a row."""
        train = self.config.train
        self.skipped_in_a_row += 1
        self.skipped_steps += 1
        what = f"step {self.step + 1}: loss {loss}, gradient norm {grad_norm}"
        if train.on_nonfinite == "stop" or self.skipped_in_a_row > train.max_skipped:
            reason = ("train.on_nonfinite=stop" if train.on_nonfinite == "stop"
                      else f"{self.skipped_in_a_row} non-finite steps in a row (train.max_skipped={train.max_skipped})")
            healthy = self.health.last_healthy
            resume = (f"Resume from {healthy[1]}, the last checkpoint confirmed healthy (checkpoint.resume="
                      f"{healthy[1]}), " if healthy else "No checkpoint of this run was confirmed healthy: start again ")
            raise NonFiniteTraining(
                f"{what} is not finite ({reason}); the model was not updated and no checkpoint holds this state. "
                f"{resume}with a lower train.lr or a train.grad_clip"
                + (", or set train.on_nonfinite=skip to drop such steps" if train.on_nonfinite == "stop" else ""))
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.model.parameters():
            param.grad = None
        if self.rank == 0:
            print(f"xscale: {what} is not finite; update skipped ({self.skipped_in_a_row} in a row)", flush=True)

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` (resuming first); on preemption save, requeue and return early."""
        try:
            return self._fit()
        finally:
            self.prefetcher.close()
            self.lock.release()

    def _fit(self) -> dict[str, Any]:
        train = self.config.train
        self.resume()
        if self.rank == 0:  # train.peak_flops, or the best GEMM rate, cached per device, dtype and torch
            dtype = torch.bfloat16 if train.low_precision else torch.float32
            self.peak_flops = MfuDenominator(dtype, str(self.device), pinned=train.peak_flops)
        if self.rank == 0 and (warning := bf16_warning("bf16" if train.low_precision else train.precision, self.device.type)):
            print(warning, flush=True)
        if self.rank == 0 and (warning := unused_attention_dropout(self.config.model)):
            print(warning, flush=True)
        if self.config.model.stack.kind == "early_exit" and (reason := exit_path_refusal(self.model)):
            self._announce(f"xscale: early-exit evaluation computes every layer: {reason}")
        if self.rank == 0:
            fp8 = (f", fp8 ({train.fp8_recipe}) on {float8_linears(self.model.parts)} linear layers"
                   if train.precision == "fp8" else "")
            print(f"xscale: {self.num_params / 1e6:.2f}M parameters, {self.dims.describe()}, "
                  f"device {self.device.type}{fp8}, {train.steps} steps of {train.global_batch_size}x{train.seq_len} "
                  "tokens", flush=True)
        losses = self._loop()
        if self.snapshots is not None:
            self.snapshots.remove()  # the last checkpoint, just saved, holds everything they did
        interrupted = self.stop_requested and self.preemption.interrupted
        if self.stop_requested and not interrupted:
            if self.rank == 0:
                print(f"xscale: stop requested; checkpoint of step {self.step} written", flush=True)
            self.preemption.requeue()
        plot = self.metrics.close(plot=train.plot and not self.stop_requested)
        return {"step": self.step, "rank": self.rank, "losses": losses, "plot": str(plot) if plot else None,
                "checkpoint": str(self.checkpointer.directory), "preempted": self.stop_requested and not interrupted,
                "interrupted": interrupted}

    def _loop(self) -> list[float]:
        """The steps, under the preemption handler and the watchdog (armed from the first step; saves and
        evaluations watched too); the last checkpoint is written."""
        train, every, losses = self.config.train, self.config.checkpoint.every, []
        eval_every = evaluation_interval(train, len(self.eval_dataset) if self.eval_dataset is not None else 0)
        watchdog, refreshed = self._watchdog(), time.monotonic()

        def watched(phase: str) -> contextlib.AbstractContextManager:
            return watchdog.watching(self.step, phase) if watchdog is not None else _nothing()

        with self.preemption, watchdog or _nothing():
            while self.step < train.steps:
                # The watched span holds every collective of the step, the stop vote included: a rank that stops
                # between steps leaves the others waiting in that vote.
                if watchdog is not None:
                    watchdog.begin(self.step + 1)
                self.profiler.before_step(self.step + 1)
                scalars = self.train_step()
                self.profiler.after_step(self.step)
                scalars.update(self.layer_metrics())  # before evaluation, whose forwards overwrite them
                stopping = self.stop_requested or self.preemption.should_stop()
                if watchdog is not None:
                    watchdog.end()
                if time.monotonic() - refreshed > LOCK_REFRESH_S:
                    self.lock.refresh()
                    refreshed = time.monotonic()
                losses.append(scalars["train/loss"])
                if eval_every and self.step % eval_every == 0 and not stopping:
                    with watched("evaluation"):
                        scalars.update(self.evaluate())
                self.metrics.log(self.step, scalars)
                if stopping:
                    self.stop_requested = True
                    break
                if self.snapshots is not None and self.step % self.config.checkpoint.memory_every == 0:
                    with watched("memory snapshot"):  # after the step is logged, as a disk save: no resumed step
                        self.take_snapshot()           # goes unlogged (a kill in between recomputes it)
                if every > 0 and self.step % every == 0 and self.step < train.steps:
                    with watched("checkpoint save"):
                        self.save()
            self.profiler.stop()
            if every >= 0 or self.stop_requested:  # -1: no checkpoint at the end; a preemption or Ctrl-C still saves
                with watched("checkpoint save"):
                    self.save()
                    self.checkpointer.wait()
        return losses


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _collect_layer_metrics(module: torch.nn.Module,
                           step_summary: Callable[[torch.nn.Module], dict[str, float] | None]) -> dict[str, float]:
    """Per-layer statistics: the last training step's where ``step_summary`` has them (MoE load over the step's
    routing groups), else what the layer recorded on its last forward."""
    metrics: dict[str, float] = {}
    for name, child in module.named_modules():
        if isinstance(child, ReportsLayerMetrics):
            summary = step_summary(child)
            for key, value in (child.layer_metrics() if summary is None else summary).items():
                metrics[f"{canonical_name(name)}/{key}"] = value
    return metrics
