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


class _CombineByGate(torch.autograd.Function):
    """out[t] = sum over kept assignments a of token t: gate[a] * rows[a]; one pass each way past the GEMMs.

    Backward: the gradient rows of the assignments are gathered once; d gate[a] = <d out[t], rows[a]> and
    d rows[a] = gate[a] * d out[t] are taken from that one gathered copy (autograd's mul + index_add would
    gather, then allocate and sweep two more full-size products).
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                out_dtype: torch.dtype) -> torch.Tensor:
        gate_rows = gate.to(rows.dtype).unsqueeze(-1)
        out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=out_dtype)
        out.index_add_(0, token_index, (rows * gate_rows).to(out_dtype))
        ctx.save_for_backward(rows, gate_rows, token_index)
        ctx.gate_dtype = gate.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, gate_rows, token_index = ctx.saved_tensors
        grad_rows = grad_out.index_select(0, token_index).to(rows.dtype)
        grad_gate = None
        if ctx.needs_input_grad[1]:
            grad_gate = torch.linalg.vecdot(grad_rows, rows).to(ctx.gate_dtype)
        return grad_rows.mul_(gate_rows), grad_gate, None, None, None


def combine_by_gate(rows: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Expert outputs of the kept assignments [A, d] -> tokens [num_tokens, d]: y[t] = sum_a gate[a] * rows[a]
    over the assignments a with ``token_index[a] == t`` (GShard's combine; a token with none gets 0)."""
    if rows.shape[0] != gate.shape[0] or rows.shape[0] != token_index.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)}, gate {tuple(gate.shape)} and token_index "
                         f"{tuple(token_index.shape)} must have one entry per assignment")
    return _CombineByGate.apply(rows, gate, token_index, num_tokens, out_dtype or rows.dtype)
