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
logits; their gradients flow back through the same chain.

Every vocabulary stage holds the whole projection under its single-process name (``output.weight``, or for tied
embeddings a copy of ``embedding.weight``) and multiplies by its rows only; the pipeline sums the copies'
gradients (:mod:`~xscale.parallel.pipeline.shared`, as for the two ends of a tied embedding), so each copy gets the
full gradient, the optimizer keeps them equal and checkpoints hold the parameter once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config import ParallelConfig
from xscale.models.transformer import Transformer


def vocabulary_stage_count(parallel: ParallelConfig) -> int:
    """The pipeline stages that hold a vocabulary shard (the last ones): one per pp rank, or none."""
    return parallel.pp if parallel.pp_vocab_parallel and parallel.pp > 1 else 0


def vocabulary_shard(stage: int, num_stages: int, shards: int) -> tuple[int, int] | None:
    """(k, shards) when pipeline stage ``stage`` of ``num_stages`` is vocabulary stage k (the last ``shards``
    stages are), else None."""
    shard = stage - (num_stages - shards)
    return (shard, shards) if shards and shard >= 0 else None


def vocabulary_rows(vocab_size: int, shard: int, shards: int) -> tuple[int, int]:
    """The rows [start, end) of shard ``shard`` of ``shards``: as even as possible, the first shards one larger."""
    base, extra = divmod(vocab_size, shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (1 if shard < extra else 0)


class VocabularyShard(nn.Module):
    """Vocabulary stage ``shard`` of ``shards`` (module docstring): ``output`` is the model's output projection,
    of which it multiplies rows :func:`vocabulary_rows` only.

    Pipeline code asks every stage what it holds (embedding, stacks, output); a vocabulary stage holds the output
    projection alone.
    """

    embedding = None
    embedding_norm = None
    stack = None
    decoder = None
    seq2seq = False

    def __init__(self, model: Transformer, shard: int, shards: int) -> None:
        super().__init__()
        self.config = model.config
        self.output = model.output
        self.kernels = model.kernels
        self.shard, self.shards = shard, shards
        self.start, self.end = vocabulary_rows(model.config.vocab_size, shard, shards)

    @property
    def ends(self) -> bool:
        """Whether this is the last vocabulary stage (it returns the loss)."""
        return self.shard == self.shards - 1

    def forward(self, hidden: torch.Tensor, log_partition: torch.Tensor | None = None,
                label_logit: torch.Tensor | None = None, *, labels: torch.Tensor,
                **_: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """(h, log Z_{k-1}, z_{k-1}) -> (h, log Z_k, z_k), or on the last stage the loss sum; the first vocabulary
        stage gets h alone. ``labels`` (B, T): this microbatch's, -100 where unlabelled."""
        bias = None if self.output.bias is None else self.output.bias[self.start:self.end]
        logits = F.linear(hidden, self.output.weight[self.start:self.end], bias).float()
        shard_partition = torch.logsumexp(logits, dim=-1)
        local = labels - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        picked = logits.gather(-1, local.clamp(0, self.end - self.start - 1).unsqueeze(-1)).squeeze(-1)
        shard_logit = torch.where(inside, picked, torch.zeros_like(picked))
        log_partition = shard_partition if log_partition is None else torch.logaddexp(log_partition, shard_partition)
        label_logit = shard_logit if label_logit is None else label_logit + shard_logit
        if not self.ends:
            return hidden.clone(), log_partition, label_logit  # a new tensor: torch detaches stage outputs in place
        labelled = labels != -100
        return torch.where(labelled, log_partition - label_logit, torch.zeros_like(label_logit)).sum()
