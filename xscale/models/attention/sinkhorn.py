"""Sparse Sinkhorn attention (Tay et al. 2020): a sorting network scores block pairs, Sinkhorn balancing turns the
scores into a soft permutation S of the N_B blocks, and each query block attends to its own block plus the
block that S sorts into its place, psi_S(K)_i = sum_j S_ij K_j. Cost T * 2b for blocks of b tokens.

  R = SortNet(block summaries),  R_i = W_2 relu(W_1 s_i + b_1) + b_2  (one row of N_B logits per block);
  S = Sinkhorn(R / tau): log-space row and column normalisation, repeated ``iterations`` times.
Block summaries s_i are the mean key of the block (per head, one network shared by the heads).

Causal (the paper's causal Sinkhorn balancing, in our form): row i may only draw from blocks j < i, whose every
token precedes every query of block i, and its summary is the mean key of those blocks; only rows are
normalised, because a column normalisation would let later blocks' scores change earlier rows. Block 0 then
has no sorted block. The own block is attended with the causal mask.
Padding of a last partial block is weighted out: a sorted slot holds the mixture of the real tokens only and
its logit gets log of their total weight. With a single block this is dense attention exactly (the sorted
block repeats the own keys, which leaves a softmax unchanged).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.compressed import blocks_of
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class SinkhornOptions:
    block_size: int = 16
    iterations: int = 8
    temperature: float = 0.75

    def __post_init__(self) -> None:
        require_positive("sinkhorn", block_size=self.block_size, iterations=self.iterations)
        require(self.temperature > 0,
                f"model.attention.options.temperature must be > 0 for 'sinkhorn' (got {self.temperature})")


def sinkhorn(log_scores: Tensor, iterations: int) -> Tensor:
    """exp of the Sinkhorn-balanced log_scores (..., n, n): rows and columns each sum to ~1."""
    for _ in range(iterations):
        log_scores = log_scores - log_scores.logsumexp(-1, keepdim=True)
        log_scores = log_scores - log_scores.logsumexp(-2, keepdim=True)
    return log_scores.exp()


@ATTENTION.register("sinkhorn")
class SinkhornAttention(AttentionCore):
    Options = SinkhornOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: SinkhornOptions) -> None:
        super().__init__(model, layer_index, options)
        self.max_blocks = -(-model.max_seq_len // options.block_size)
        self.sort_hidden = nn.Linear(model.head_dim, model.head_dim)
        self.sort_output = nn.Linear(model.head_dim, self.max_blocks)

    def sort_logits(self, summaries: Tensor) -> Tensor:
        """(B, H, n, d) block summaries -> (B, H, n, n) R."""
        n_blocks = summaries.shape[2]
        logits = self.sort_output(torch.relu(self.sort_hidden(summaries.to(self.sort_hidden.weight.dtype))))
        return logits[..., :n_blocks].to(summaries.dtype)

    def sort_matrix(self, k_blocks: Tensor, valid: Tensor, causal: bool) -> Tensor:
        """S (B, H, n, n) from the key blocks (B, H, n, b, d) and the real-token mask valid (n, b)."""
        counts = valid.sum(-1).to(k_blocks.dtype)  # (n,)
        block_sums = k_blocks.sum(3)  # padding is zero
        if causal:
            before = torch.cumsum(block_sums, 2) - block_sums  # blocks < i
            summaries = before / (torch.cumsum(counts, 0) - counts).clamp_min(1)[:, None]
        else:
            summaries = block_sums / counts[:, None]
        log_scores = self.sort_logits(summaries) / self.options.temperature
        if not causal:
            return sinkhorn(log_scores, self.options.iterations)
        n = log_scores.shape[-1]
        past = torch.ones(n, n, dtype=torch.bool, device=log_scores.device).tril(-1)
        weights = torch.softmax(log_scores.masked_fill(~past, float("-inf")), dim=-1)
        return torch.where(past, weights, 0.0)  # row 0 (no past) is all zero, not NaN

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        length, block = q.shape[2], self.options.block_size
        require(k.shape[2] == length, "sinkhorn attention is self-attention (equal query and key lengths)")
        if length > self.max_blocks * block:
            raise ValueError(f"sinkhorn was built for at most model.max_seq_len={self.model_config.max_seq_len} "
                             f"tokens and got {length}; raise model.max_seq_len")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        q_blocks, k_blocks, v_blocks = blocks_of(q, block), blocks_of(k, block), blocks_of(v, block)
        n_blocks = k_blocks.shape[2]
        valid = (torch.arange(n_blocks * block, device=q.device) < length).view(n_blocks, block)
        sort = self.sort_matrix(k_blocks, valid, causal)
        mass = torch.einsum("bhij,jt->bhit", sort, valid.to(sort.dtype))  # (B, H, n, b) real weight per slot
        sorted_keys = torch.einsum("bhij,bhjtd->bhitd", sort, k_blocks) / mass.clamp_min(1e-30)[..., None]
        sorted_values = torch.einsum("bhij,bhjtd->bhitd", sort, v_blocks) / mass.clamp_min(1e-30)[..., None]
        scale = q.shape[-1] ** -0.5
        own = (q_blocks @ k_blocks.transpose(-1, -2)) * scale  # (B, H, n, b, b)
        allowed = valid[:, None, :].expand(n_blocks, block, block)
        if causal:
            allowed = allowed & torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
        own = own.masked_fill(~allowed[None, None], float("-inf"))
        sorted_logits = (q_blocks @ sorted_keys.transpose(-1, -2)) * scale
        log_mass = torch.where(mass > 0, mass.clamp_min(1e-30).log(), float("-inf"))
        sorted_logits = sorted_logits + log_mass[..., None, :]
        probs = torch.softmax(torch.cat([own, sorted_logits], dim=-1), dim=-1)
        probs = self.dropout(probs, context)
        out = probs[..., :block] @ v_blocks + probs[..., block:] @ sorted_values
        return out.flatten(2, 3)[:, :, :length]
