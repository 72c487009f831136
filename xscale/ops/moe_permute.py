"""MoE token permutation: group the (token, slot) pairs by expert, then weight and sum the expert outputs back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Permutation:
    """Where each of the N*k (token, slot) pairs goes when the pairs are sorted by expert id (stable).

    token_of[p]: the token at permuted row p; pair_of[p]: its flat pair index t*k + j;
    position[t, j]: the permuted row of pair (t, j); tokens_per_expert[e]: rows of expert e (contiguous, in order).
    """

    token_of: torch.Tensor
    pair_of: torch.Tensor
    position: torch.Tensor
    tokens_per_expert: torch.Tensor


def plan_permutation(expert_ids: torch.Tensor, num_experts: int) -> Permutation:
    """expert_ids (N, k) int: the experts each token is routed to."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    flat = expert_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}); got [{int(flat.min())}, {int(flat.max())}]")
    top_k = expert_ids.shape[1]
    pair_of = torch.argsort(flat, stable=True)
    position = torch.empty_like(pair_of)
    position[pair_of] = torch.arange(flat.numel(), device=flat.device)
    return Permutation(token_of=pair_of // top_k, pair_of=pair_of, position=position.view(expert_ids.shape),
                       tokens_per_expert=torch.bincount(flat, minlength=num_experts))


def permute_reference(tokens: torch.Tensor, plan: Permutation) -> torch.Tensor:
    return tokens[plan.token_of]


def unpermute_reference(expert_out: torch.Tensor, plan: Permutation, gate_weights: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * expert_out[position[t, j]], accumulated in float32."""
    gathered = expert_out[plan.position].float()
    return (gathered * gate_weights.float().unsqueeze(-1)).sum(1).to(expert_out.dtype)
