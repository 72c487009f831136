"""One optimizer step's forward and backward, under any layout.

The contract, which the parity tests check: the loss returned and the gradients left are those of the
single-process model on the whole global batch, where the loss is the mean token cross-entropy over every labelled
token of the global batch, plus the MoE auxiliary losses averaged over the step's routing groups. Each microbatch's
summed token loss is divided by the global count of labelled tokens, so the gradients summed over microbatches and
data-parallel ranks are the global mean's. The layout (:class:`~xscale.parallel.model.ParallelModel`) adds what it
must: gradient sums after the last backward, this rank's place in every forward's context, its share of the tokens,
or, under pipeline parallelism, the schedule that runs every microbatch through the stages.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from xscale.config.schema import TrainConfig
from xscale.estimate.step_runner import StepRunner
from xscale.parallel.data.grad_norm import clip_gradients
from xscale.parallel.loss import model_inputs, model_loss_sum, prediction_counts
from xscale.parallel.model import Batch, ParallelModel
from xscale.runtime import StepContext
from xscale.train.optim import build_optimizer
from xscale.train.training_step import begin_training_step


def split_microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    size = model_inputs(batch).shape[0]
    return [{key: value[start:start + micro_batch_size] for key, value in batch.items()}
            for start in range(0, size, micro_batch_size)]


def labelled_tokens(batch: Batch) -> torch.Tensor:
    """Labelled tokens in this rank's batch."""
    return (batch["labels"] != -100).sum()


def global_token_count(model: ParallelModel, batch: Batch) -> torch.Tensor:
    """Labelled tokens in the global batch (summed over the data-parallel ranks), at least 1."""
    return model.data_parallel.global_token_count(labelled_tokens(batch)).clamp_min(1)


def forward_backward_step(model: ParallelModel, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
    """Forward and backward of this rank's batch (its share of the global batch); returns the global-batch mean
    loss (detached, on the CPU). ``context``: where the batch sits in the run (step, first global sample), so each
    microbatch draws the dropout masks of its rows in the global batch, as on one device."""
    for part in model.parts:
        part.train()
    data_parallel = model.data_parallel
    token_count = data_parallel.start_token_count(labelled_tokens(batch))
    microbatches = model.microbatches_per_batch(model_inputs(batch).shape[0])
    moe_loss_scale = model.routing_groups.begin_step(microbatches)
    begin_training_step(model.parts, microbatches * data_parallel.replicas)
    context = replace(context if context is not None else StepContext(), moe_loss_scale=moe_loss_scale)
    if model.pipeline is not None:
        with model.autocast():
            total = model.pipeline.step(model.shard_batch(batch), context, token_count().clamp_min(1),
                                        model.routing_groups)
        data_parallel.after_backward()
        loss_sum = data_parallel.start_loss_reduction(total)
    else:
        # The global token count travels during the first forward, the loss's sum during the last backward.
        total = torch.zeros((), dtype=torch.float32, device=model.device)
        tokens = None
        micros = split_microbatches(batch, model.micro_batch_size)
        for index, micro in enumerate(micros):
            last = index == len(micros) - 1
            data_parallel.requires_gradient_sync(last)
            micro_context = model.place(context.microbatch(index, model.micro_batch_size))
            with model.autocast():
                loss = model_loss_sum(model.model, model.shard_batch(micro), micro_context)
            tokens = token_count().clamp_min(1) if tokens is None else tokens
            loss = loss / tokens
            total += loss.detach().float()
            if last:
                loss_sum = data_parallel.start_loss_reduction(total)
            loss.backward()
        data_parallel.after_backward()
    model.routing_groups.end_step()
    return loss_sum().cpu()


@torch.no_grad()
def evaluation_loss(model: ParallelModel, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
    """The global-batch mean token loss of ``batch`` in evaluation mode (no dropout); ``context``: where the batch
    sits (its rows' first global sample, a segment memory), microbatch by microbatch as in training."""
    for part in model.parts:
        part.eval()
    tokens = global_token_count(model, batch)
    with model.autocast():
        if model.pipeline is not None:
            total = model.pipeline.evaluate(model.shard_batch(batch), tokens, model.routing_groups)
        else:
            total = torch.zeros((), dtype=torch.float32, device=model.device)
            base = StepContext() if context is None else context
            for index, micro in enumerate(split_microbatches(batch, model.micro_batch_size)):
                micro_context = model.place(base.microbatch(index, model.micro_batch_size) if context is not None else base)
                total += (model_loss_sum(model.model, model.shard_batch(micro), micro_context) / tokens).float()
    return model.data_parallel.reduce_loss(total).cpu()


def exit_path_refusal(model: ParallelModel) -> str | None:
    """Why evaluation of an early-exit classifier computes every exit rather than stopping each example at its
    exit (None: it stops): rows that are not independent examples, or a layout whose forward needs every rank."""
    if model.data_parallel.gathers_in_forward:
        return ("parallel.zero_stage=3 gathers each block's parameters with every rank together, so no rank can "
                "stop before the others")
    return model.model.exits.rows_coupled


@torch.no_grad()
def evaluation_predictions(model: ParallelModel, batch: Batch, exits: bool = False) -> dict[str, float]:
    """A classifier's accuracy over the global batch (evaluation mode), and with ``exits`` (early exit) the accuracy
    at full depth, the mean 1-based exit layer and the fraction of the full depth's layer-rows computed (realised:
    each example stopped at its exit, unless :func:`exit_path_refusal` says why not; then 1)."""
    for part in model.parts:
        part.eval()
    exit_early = exits and exit_path_refusal(model) is None
    counts = torch.zeros(5, dtype=torch.long, device=model.device)
    with model.autocast():
        for micro in split_microbatches(batch, model.micro_batch_size):
            counts += prediction_counts(model.model, micro, model.place(StepContext()), exit_early)
    examples = global_token_count(model, batch)
    counts = model.data_parallel.global_token_count(counts)
    accuracy, full_depth, layers = (float(count / examples) for count in counts[:3])
    if not exits:
        return {"accuracy": accuracy}
    return {"accuracy": accuracy, "accuracy_full_depth": full_depth, "mean_exit_layer": layers,
            "exit_compute_fraction": float(counts[3] / counts[4].clamp_min(1))}


def clip_gradient_norm(model: ParallelModel, max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global gradient norm (every distinct gradient element
    of the whole model once, over every rank: :mod:`xscale.parallel.data.grad_norm`)."""
    spread = model.data_parallel.mesh is not None or model.pipeline is not None
    if spread and not model.data_parallel.gradients_whole_on_every_rank:  # pieces spread over ranks
        return clip_gradients(model.gradient_pieces(), max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params])


def model_optimizer(model: ParallelModel, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over what this rank updates: whole parameters, DTensor shards or ZeRO chunks."""
    params = model.data_parallel.optimizer_parameters()
    source_ndim = {id(shard): entry.param.ndim for shard, entry in zip(params, model.data_parallel.parameters)}
    return build_optimizer(params, train, source_ndim)


def optimizer_step(model: ParallelModel, optimizer: torch.optim.Optimizer) -> None:
    """Step and zero the gradients (ZeRO: each rank its chunk, then the updated chunks gathered)."""
    model.data_parallel.optimizer_step(optimizer)


# The step a memory measurement runs (``xscale inspect --measure``, :mod:`xscale.estimate.measure`).
TRAINING_STEP = StepRunner(optimizer=model_optimizer, forward_backward=forward_backward_step)
