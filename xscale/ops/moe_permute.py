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
    if flat.numel():
        low, high = torch.stack(torch.aminmax(flat)).tolist()  # one device-to-host copy (one GPU sync), not four
        if low < 0 or high >= num_experts:
            raise ValueError(f"expert ids must lie in [0, {num_experts}); got [{low}, {high}]")
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


def assignment_of_token(token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens]: the assignment row of each token, or ``len(token_index)`` for a token with none.

    Only for routings that keep at most one assignment per token (top-1): it turns the scatters of
    dispatch and combine into gathers, which are parallel and need no zero-filled output first.
    """
    rows = torch.full((num_tokens,), token_index.numel(), dtype=torch.long, device=token_index.device)
    rows[token_index] = torch.arange(token_index.numel(), device=token_index.device)
    return rows


def _gather_with_zero_row(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] where index == len(rows) reads a zero row."""
    if rows.shape[0] == 0:
        return rows.new_zeros((index.shape[0], *rows.shape[1:]))
    out = rows.index_select(0, index.clamp(max=rows.shape[0] - 1))
    missing = (index == rows.shape[0]).nonzero().squeeze(1)
    if missing.numel():
        out.index_fill_(0, missing, 0.0)
    return out


class _GatherTokens(torch.autograd.Function):
    """tokens[token_index]; backward scatters (sums) the rows' gradients back onto their tokens."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, token_index: torch.Tensor, assignment: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(token_index, assignment)
        ctx.num_tokens = tokens.shape[0]
        return tokens.index_select(0, token_index)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        token_index, assignment = ctx.saved_tensors
        grad_rows = grad_rows.contiguous()
        if assignment is not None:  # at most one row per token: a gather
            return _gather_with_zero_row(grad_rows, assignment), None, None
        grad = grad_rows.new_zeros((ctx.num_tokens, grad_rows.shape[-1]))
        return grad.index_add_(0, token_index, grad_rows), None, None


def gather_tokens(tokens: torch.Tensor, token_index: torch.Tensor,
                  assignment: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the rows [A, d] of tokens [N, d] that the kept assignments read. ``assignment``
    (:func:`assignment_of_token`, when each token has at most one assignment) makes the backward a gather."""
    return _GatherTokens.apply(tokens, token_index, assignment)


class _CombineByGate(torch.autograd.Function):
    """out[t] = sum over kept assignments a of token t: gate[a] * rows[a]; one pass each way past the GEMMs.

    Backward: the gradient rows of the assignments are gathered once; d gate[a] = <d out[t], rows[a]> and
    d rows[a] = gate[a] * d out[t] are taken from that one gathered copy (autograd's mul + index_add would
    gather, then allocate and sweep two more full-size products). With at most one assignment per token the
    forward is a gather of the weighted rows instead of a zero fill and a scatter-add.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                out_dtype: torch.dtype, assignment: torch.Tensor | None) -> torch.Tensor:
        gate_rows = gate.to(rows.dtype).unsqueeze(-1)
        weighted = (rows * gate_rows).to(out_dtype)
        if assignment is not None:
            out = _gather_with_zero_row(weighted, assignment)
        else:
            out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=out_dtype).index_add_(0, token_index, weighted)
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
        return grad_rows.mul_(gate_rows), grad_gate, None, None, None, None


def combine_by_gate(rows: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                    out_dtype: torch.dtype | None = None, assignment: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs of the kept assignments [A, d] -> tokens [num_tokens, d]: y[t] = sum_a gate[a] * rows[a]
    over the assignments a with ``token_index[a] == t`` (GShard's combine; a token with none gets 0).
    ``assignment``: :func:`assignment_of_token`, when each token has at most one assignment (faster)."""
    if rows.shape[0] != gate.shape[0] or rows.shape[0] != token_index.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)}, gate {tuple(gate.shape)} and token_index "
                         f"{tuple(token_index.shape)} must have one entry per assignment")
    return _CombineByGate.apply(rows, gate, token_index, num_tokens, out_dtype or rows.dtype, assignment)
