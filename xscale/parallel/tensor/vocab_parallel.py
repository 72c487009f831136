"""Vocabulary-parallel embedding and cross-entropy: each rank holds the rows of its vocabulary shard only.

Embedding (Megatron-LM's VocabParallelEmbedding, Shoeybi et al. 2019): each rank looks up the ids that fall in
its shard, zeros the rest, and the partial embeddings are summed over the group (all-reduce), or summed and
split by sequence (reduce-scatter) under sequence parallelism. The gradient touches only the rank's rows.
(torch 2.13's RowwiseParallel embedding computes a full vocab x d gradient on every rank instead.)

Cross-entropy: for token t with target y, loss_t = log sum_v exp(z_tv - m_t) - (z_ty - m_t), m_t = max_v z_tv. Each rank
computes its shard's max, then its shard's sum of exp(z - m) and the target logit if y falls in its shard;
one all-reduce (max) and one all-reduce (sum of the two stacked) give the loss on every rank. The gradient,
softmax(z) - onehot(y), is local to each shard: backward communicates nothing (Megatron-LM's
``vocab_parallel_cross_entropy``, Shoeybi et al. 2019, sec. 3). Full (tokens, vocab) logits never exist.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

IGNORE_INDEX = -100


class VocabParallelCrossEntropySum(torch.autograd.Function):
    """(local logits (..., V/P), labels (...), first vocab id of the shard, group) -> sum of token losses."""

    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = local_logits.float()
        shard_size = logits.shape[-1]
        maximum = logits.amax(dim=-1)
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()

        labelled = labels != IGNORE_INDEX
        local_target = labels - vocab_start
        in_shard = labelled & (local_target >= 0) & (local_target < shard_size)
        index = torch.where(in_shard, local_target, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1) * in_shard

        sums = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums.unbind(0)
        losses = (sum_exp.log() - target_logit) * labelled

        exp.div_(sum_exp.unsqueeze(-1))  # now the shard's softmax, kept for backward
        ctx.save_for_backward(exp, index, in_shard, labelled)
        ctx.input_dtype = local_logits.dtype
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        softmax, index, in_shard, labelled = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -in_shard.unsqueeze(-1).to(grad.dtype))
        grad.mul_((labelled.unsqueeze(-1) * grad_output).to(grad.dtype))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy_sum(local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                     group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of token cross-entropies over labels != -100, from this rank's vocabulary shard of the logits.

    ``local_logits`` (..., V/P) holds vocab ids [vocab_start, vocab_start + V/P); ``labels`` (...) are global
    ids. Every rank of ``group`` returns the same value; computed in float32.
    """
    return VocabParallelCrossEntropySum.apply(local_logits, labels, vocab_start, group)


def vocab_sharded_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over labels != -100 from logits that are a DTensor sharded on the vocabulary
    dim (a tensor-parallel output projection's); every rank of the logits' mesh returns the same value."""
    vocab_sharded = isinstance(logits, DTensor) and logits.placements[0].is_shard() and (
        logits.placements[0].dim % logits.ndim == logits.ndim - 1)
    if not vocab_sharded:
        raise ValueError("the vocabulary-parallel loss needs logits sharded on the vocabulary (a model split by "
                         "apply_tensor_parallel); use model_loss_sum on one device")
    local = logits.to_local()
    mesh = logits.device_mesh
    vocab_start = mesh.get_local_rank() * local.shape[-1]
    return vocab_parallel_cross_entropy_sum(local, labels, vocab_start, mesh.get_group())


class VocabParallelEmbedding(nn.Module):
    """Replaces an ``nn.Embedding``; ``weight`` is a DTensor sharded on the vocabulary dim (same name, same
    checkpoint key). ``output_layout``: Replicate() gives every rank the full sequence, Shard(1) its shard."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, output_layout: Placement | None = None) -> None:
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding supports neither padding_idx nor max_norm")
        if embedding.num_embeddings % mesh.size():
            raise ValueError(f"vocabulary of {embedding.num_embeddings} rows does not split over {mesh.size()} ranks")
        self.mesh = mesh
        self.output_layout = output_layout or Replicate()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.shard_rows = embedding.num_embeddings // mesh.size()
        self.vocab_start = mesh.get_local_rank() * self.shard_rows
        weight = distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
        self.weight = nn.Parameter(weight, requires_grad=embedding.weight.requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.shard_rows)
        rows = nn.functional.embedding(local_ids.masked_fill(outside, 0), self.weight.to_local())
        partial = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        summed = DTensor.from_local(partial, self.mesh, [Partial()], run_check=False)
        return summed.redistribute(self.mesh, [self.output_layout]).to_local()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
                f"{self.vocab_start + self.shard_rows}), output {self.output_layout}")
