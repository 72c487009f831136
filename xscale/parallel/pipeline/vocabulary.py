"""Vocabulary parallelism over the pipeline: the output projection and the cross-entropy split by vocabulary across
the pp ranks, as the pipeline's last pp stages (``parallel.pp_vocab_parallel``; Yeung et al. 2024, "Balancing
Pipeline Parallelism with Vocabulary Parallelism").

Without it the last stage runs the output projection (2 d V FLOPs per token) and the loss on top of its blocks; with
a large vocabulary or few blocks per stage no whole-block split balances that. Here the last block stage sends the
hidden states h the projection reads, and vocabulary stage k of p (one on every pp rank) adds the rows V_k of the
vocabulary to two running per-token sums (log-sum-exp accumulation, as in online softmax):

  log Z_k = logaddexp(log Z_{k-1}, logsumexp_{v in V_k} h . w_v)    the partition function over V_1 .. V_k
  z_k     = z_{k-1} + [y in V_k] h . w_y                            the label's logit, from the shard holding it

and passes them on with h. The last one returns sum over labelled tokens of log Z_p - z_p: the token cross-entropy
sum of the single-process loss (:func:`xscale.parallel.loss.token_loss_sum`). Each rank computes 1/p of the
logits; their gradients flow back through the same chain. Under tensor parallelism each tp rank of a vocabulary stage
holds a share of the stage's rows (the projection column-parallel, as on a last stage) and the tp ranks combine their
shares' sums: log Z over V_k is m + log sum_t sum_{v in V_kt} exp(h . w_v - m), with m the largest logit over the tp
ranks, and the label's logit is summed over them.

The vocabulary stage on pp rank r holds rows V_r of the projection only (``output.weight`` [|V_r|, d],
``output.bias``), under the single-process names: the head's parameters, gradients and optimizer states are split
p ways, not copied. The chain visits the ranks' rows in the pipeline's stage order (ZB-V's runs from the last rank
down); the sums do not depend on the order.
Checkpoints show the rows as one [V, d] tensor sharded over the pp ranks
(:mod:`~xscale.parallel.pipeline.vocabulary_state`). With tied embeddings the rows are a copy of the embedding's
rows V_r; the pipeline sums the gradients of the embedding and of its row copies
(:mod:`~xscale.parallel.pipeline.shared`), so the optimizer keeps them equal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.config.schema import ParallelConfig
from xscale.models.init import copy_into, initial_value
from xscale.models.transformer import Transformer
from xscale.parallel.tensor.replicated import SumValues


def vocabulary_stage_count(parallel: ParallelConfig) -> int:
    """The pipeline stages that hold a vocabulary shard (the last ones): one per pp rank, or none."""
    return parallel.pp if parallel.pp_vocab_parallel and parallel.pp > 1 else 0


def _log_sum_exp(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """log sum over the last dim of exp(logits), the dim split over ``group`` when given (tensor parallel)."""
    if group is None:
        return torch.logsumexp(logits, dim=-1)
    largest = logits.detach().amax(dim=-1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    shares = (logits - largest.unsqueeze(-1)).exp().sum(dim=-1)
    return largest + SumValues.apply(shares, group).log()


class VocabularyPlace(NamedTuple):
    """Where a vocabulary stage sits: at ``position`` of ``shards`` in the chain (the pipeline's stage order), run by
    pp rank ``rank``, whose rows it holds (:func:`vocabulary_rows` of ``rank``): pp rank r holds the r-th piece of the
    projection, as a DTensor sharded over the pp ranks would, under any stage placement."""

    position: int
    shards: int
    rank: int


def vocabulary_shard(stage: int, stage_ranks: list[int], shards: int) -> VocabularyPlace | None:
    """Where pipeline stage ``stage`` sits as a vocabulary stage (the last ``shards`` of the stages placed on pp
    ranks ``stage_ranks`` are), or None when it is a block stage."""
    position = stage - (len(stage_ranks) - shards)
    return VocabularyPlace(position, shards, stage_ranks[stage]) if shards and position >= 0 else None


def vocabulary_rows(vocab_size: int, shard: int, shards: int) -> tuple[int, int]:
    """The rows [start, end) of shard ``shard`` of ``shards``: ceil(V / shards) rows each, the last shard the rest
    (torch.chunk's split, which is how a DTensor sharded on dim 0 splits, so checkpoints can describe the shards as
    one tensor)."""
    size = -(-vocab_size // shards)
    start = min(shard * size, vocab_size)
    return start, min(start + size, vocab_size)


def every_shard_has_rows(vocab_size: int, shards: int) -> bool:
    """Whether splitting ``vocab_size`` rows :func:`vocabulary_rows`'s way leaves no shard empty."""
    return (shards - 1) * -(-vocab_size // shards) < vocab_size


class VocabularyShard(nn.Module):
    """A vocabulary stage at ``place`` (module docstring): ``output`` holds its rank's rows :func:`vocabulary_rows`
    of the model's output projection; ``shard`` is its position in the chain.

    Pipeline code asks every stage what it holds (embedding, stacks, output); a vocabulary stage holds the output
    projection alone.
    """

    embedding = None
    embedding_norm = None
    stack = None
    decoder = None
    seq2seq = False

    def __init__(self, model: Transformer, place: VocabularyPlace) -> None:
        super().__init__()
        self.config = model.config
        self.kernels = model.kernels
        self.shard, self.shards = place.position, place.shards
        self.start, self.end = vocabulary_rows(model.config.vocab_size, place.rank, place.shards)
        whole = model.output
        self.output = nn.Linear(whole.in_features, self.end - self.start, bias=whole.bias is not None,
                                device=whole.weight.device, dtype=whole.weight.dtype)

    def source_name(self, name: str) -> str:
        """The single-process parameter whose rows ``output.<name>`` holds (a tied weight: the embedding's)."""
        return "embedding.weight" if name == "weight" and self.config.tie_embeddings else f"output.{name}"

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """The single-process initial values' rows (:func:`xscale.models.init.initial_value`); under tensor
        parallelism this tp rank's share of them."""
        for name, param in self.output.named_parameters():
            shape = torch.Size((self.config.vocab_size, *param.shape[1:]))
            copy_into(param, initial_value(self.source_name(name), shape, self.config, seed)[self.start:self.end])

    @property
    def ends(self) -> bool:
        """Whether this is the last vocabulary stage (it returns the loss)."""
        return self.shard == self.shards - 1

    def forward(self, hidden: torch.Tensor, log_partition: torch.Tensor | None = None,
                label_logit: torch.Tensor | None = None, *, labels: torch.Tensor,
                **_: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """(h, log Z_{k-1}, z_{k-1}) -> (h, log Z_k, z_k), or on the last stage the loss sum; the first vocabulary
        stage gets h alone. ``labels`` (B, T): this microbatch's, -100 where unlabelled."""
        logits, start, group = self.output(hidden), self.start, None
        if isinstance(logits, DTensor):  # tensor parallel: this tp rank's share of the rows, as the logits' columns
            mesh = logits.device_mesh
            start += vocabulary_rows(self.end - self.start, mesh.get_local_rank(), mesh.size())[0]
            logits, group = logits.to_local(), mesh.get_group()
        logits = logits.float()
        shard_partition = _log_sum_exp(logits, group)
        local, rows = labels - start, logits.shape[-1]
        inside = (local >= 0) & (local < rows)
        picked = logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        shard_logit = torch.where(inside, picked, torch.zeros_like(picked))
        if group is not None:
            shard_logit = SumValues.apply(shard_logit, group)
        log_partition = shard_partition if log_partition is None else torch.logaddexp(log_partition, shard_partition)
        label_logit = shard_logit if label_logit is None else label_logit + shard_logit
        if not self.ends:
            return hidden.clone(), log_partition, label_logit  # a new tensor: torch detaches stage outputs in place
        labelled = labels != -100
        return torch.where(labelled, log_partition - label_logit, torch.zeros_like(label_logit)).sum()
