"""The one training loss of every layout: the sum of token cross-entropies over labelled tokens (a classifier's:
of class cross-entropies over its examples, each example one labelled "token").

Engines divide it by the global count of labelled tokens, so sums over microbatches, data-parallel and
context-parallel ranks and pipeline microbatches give the single-process mean. The output projection is applied
here, fused with the cross-entropy so the (tokens x vocabulary) logits never exist (chunked in PyTorch, or the
Triton kernel); under tensor parallelism, where the projection is split by vocabulary, each rank computes its
vocabulary shard's logits and :func:`~xscale.parallel.tensor.vocab_parallel.vocab_sharded_loss_sum` combines them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from xscale.config.schema import ModelConfig
from xscale.models.stacks import stack_loss_positions
from xscale.ops import cross_entropy_sum, linear_cross_entropy_sum
from xscale.parallel.tensor.vocab_parallel import vocab_sharded_loss_sum
from xscale.runtime import StepContext

Batch = dict[str, torch.Tensor]


def model_inputs(batch: Batch) -> torch.Tensor:
    """What the model's forward reads: ``pixels`` (B, C, H, W) for a patch-embedding classifier (model.input=patches,
    an image batch carries no ``input_ids``), else ``input_ids`` (B, T). Row b of every key is example b."""
    return batch["pixels"] if "pixels" in batch else batch["input_ids"]


def positions_read(batch: Batch, seq_len: int) -> int:
    """Sequence positions the model reads for ``batch`` (throughput's tokens): its token ids, or ``seq_len`` (class
    token and patches) per image."""
    inputs = model_inputs(batch)
    return inputs.shape[0] * seq_len if "pixels" in batch else inputs.numel()


def split_by_vocabulary(output: nn.Module) -> bool:
    """Whether tensor parallelism split ``output``'s rows (the vocabulary) over a ``tp`` mesh dimension."""
    weight = output.weight
    if not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    return any(name == "tp" and placement.is_shard(0) for name, placement in zip(names, weight.placements))


def token_loss_sum(hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor, kernels: str = "auto",
                   gradient_in_forward: bool = True) -> torch.Tensor:
    """Sum over labels != -100 of the cross-entropy of ``output(hidden)`` (the hidden states the output projection
    reads: ``Transformer.forward(..., project=False)``); ``kernels``: the fused op's backend;
    ``gradient_in_forward``: whether the fused op may compute its gradient in the forward (one backward follows
    each forward, :mod:`xscale.ops.chunked_cross_entropy`)."""
    if split_by_vocabulary(output):
        return vocab_sharded_loss_sum(output(hidden), labels)
    if output.bias is None:
        return linear_cross_entropy_sum(hidden, output.weight, labels, backend=kernels,
                                        gradient_in_forward=gradient_in_forward)
    return cross_entropy_sum(output(hidden), labels)


def model_loss_sum(model: nn.Module, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
    """:func:`token_loss_sum` of ``model`` on ``batch`` (input_ids, labels, and decoder_input_ids for an
    encoder-decoder model) at ``context``; for a classifier, :func:`classification_loss_sum`."""
    if getattr(model, "classifier", None) is not None:
        return classification_loss_sum(model, batch, context)
    head = getattr(model, "objective_head", None)
    if head is not None:
        return objective_loss_sum(model, head, batch, context)
    hidden = model(batch["input_ids"], decoder_input_ids=batch.get("decoder_input_ids"), context=context,
                   project=False)
    # A stack whose output holds the last positions only (Perceiver AR, which refuses tp, sp and cp) is read against
    # their labels; any other output is the whole (or, under sequence parallelism, a shard of the) sequence.
    positions = stack_loss_positions(model.config) if isinstance(getattr(model, "config", None), ModelConfig) else 0
    labels = batch["labels"][:, -positions:] if positions else batch["labels"]
    return token_loss_sum(hidden, model.output, labels, model.kernels)


def objective_loss_sum(model: nn.Module, head: nn.Module, batch: Batch, context: StepContext | None) -> torch.Tensor:
    """An encoder with an objective's extra head (:mod:`xscale.models.heads.objective`): the MLM loss (unless the
    head replaces it) plus the head's; ELECTRA's generator first makes the token ids the model reads. Under ZeRO-3
    the root unit's parameters (the shared embedding, the head) are gathered before the generator reads them."""

    def token_loss(states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(states, model.output, labels, model.kernels)

    loss = torch.zeros((), device=batch["input_ids"].device)
    if head.corrupts_inputs:
        if isinstance(model, FSDPModule):
            model.unshard()
        corrupted, loss = head.corrupt(model.embedding, model.output, batch, token_loss,
                                       context if context is not None else StepContext())
        batch = {**batch, "input_ids": corrupted}
    hidden = model(batch["input_ids"], context=context, project=False)
    if head.adds_to_token_loss:
        loss = loss + token_loss(hidden, batch["labels"])
    return loss + head.loss_sum(hidden, batch, token_loss)


def classification_loss_sum(model: nn.Module, batch: Batch, context: StepContext | None = None) -> torch.Tensor:
    """Sum over the batch's examples of the cross-entropy of the class logits; ``batch``: input_ids (B, T) and
    padding_mask (B, T), or pixels (B, C, H, W), and one class index per example, labels (B,) (engines divide by
    the global example count). With early exit (logits of every layer), the weighted average of the layers' losses
    (PABEE's)."""
    logits = model(model_inputs(batch), context=context, padding_mask=batch.get("padding_mask"))
    if logits.dim() == 3:
        return model.exits.loss_sum(logits, batch["labels"])
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", ignore_index=-100)


@torch.no_grad()
def prediction_counts(model: nn.Module, batch: Batch, context: StepContext | None = None,
                      exit_early: bool = False) -> torch.Tensor:
    """A classifier's [examples labelled right, right at full depth, sum of the 1-based exit layers, layer-rows
    computed to reach the predictions, layer-rows at full depth] over ``batch``: the top class, or with early exit
    each example's exit layer's. One forward computes every exit (every layer-row computed); ``exit_early``: the
    predictions come from the forward that stops each example at its exit (``Transformer.forward(exit_early=True)``),
    counting the layer-rows it ran, and a second, full-depth forward gives the full-depth accuracy. Without early
    exit the last three are 0."""
    inputs, mask, labels = model_inputs(batch), batch.get("padding_mask"), batch["labels"]
    logits = model(inputs, context=context, padding_mask=mask)
    if logits.dim() != 3:
        correct = (logits.argmax(dim=-1) == labels).sum()
        return torch.cat([torch.stack([correct, correct]), correct.new_zeros(3)])
    full_depth = logits[-1].argmax(dim=-1)
    full_rows = torch.tensor(logits.shape[0] * logits.shape[1], device=labels.device)
    if exit_early:
        classes, layers, ran = model(inputs, context=context, padding_mask=mask, exit_early=True).unbind(dim=-1)
        computed = ran.sum()
    else:
        (classes, layers), computed = model.exits.predict(logits), full_rows
    return torch.stack([(classes == labels).sum(), (full_depth == labels).sum(), (layers + 1).sum(), computed,
                        full_rows])
