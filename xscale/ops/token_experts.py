"""Top-1 experts by token: dispatch, expert FFN and gated combine in one pass per expert (GShard / Switch).

With at most one kept assignment per token (top-1), the MoE layer's y_t = g_t FFN_e(t)(x_t) (0 for a dropped token)
touches every token row once. Gathering all routed rows, running the experts and scattering the weighted outputs
back as three passes over the (tokens, d) activations costs as much as a GEMM's worth of memory traffic on a CPU;
here each expert gathers its own rows, runs its FFN (:mod:`xscale.ops.grouped_mlp`), weighs them by the gates and
writes them to their tokens while they are in cache, the experts side by side on the CPU threads
(:func:`xscale.ops.expert_threads.for_each_expert`). The backward mirrors it: each expert gathers its rows'
output gradients, takes d g = <dy, FFN(x)> and g dy, and writes its input gradients to its tokens.
Saved for backward: the gathered rows, the activations and the unweighted expert outputs (what the unfused
dispatch and combine save). The arithmetic is the unfused path's, op for op (tested against it).
"""

from __future__ import annotations

import torch

from xscale.ops.expert_threads import for_each_expert
from xscale.ops.grouped_mlp import (
    ExpertActivations,
    ExpertGradients,
    ExpertWeights,
    autocast_operands,
    check_experts,
    expert_backward,
    expert_forward,
)


def _rows_without_assignment(token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The token rows no kept assignment writes (dropped tokens): their output and gradient are zero."""
    covered = torch.zeros(num_tokens, dtype=torch.bool, device=token_index.device)
    covered[token_index] = True
    return (~covered).nonzero().squeeze(1)


class _TokenExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, token_index, gate, w1, b1, w_up, b_up, w2, b2, counts, activation, out_dtype):
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, activation)
        saved = ExpertActivations.empty(tokens.new_empty((token_index.shape[0], tokens.shape[1])), weights)
        expert_out = tokens.new_empty((token_index.shape[0], w2.shape[1]))
        gate_rows = gate.to(tokens.dtype).unsqueeze(-1)
        out = tokens.new_empty((tokens.shape[0], w2.shape[1]), dtype=out_dtype)
        dropped = _rows_without_assignment(token_index, tokens.shape[0])
        out.index_fill_(0, dropped, 0.0)

        def forward_rows(expert: int, rows: slice) -> None:
            torch.index_select(tokens, 0, token_index[rows], out=saved.x[rows])
            expert_forward(weights, expert, saved, rows, expert_out[rows])
            out.index_copy_(0, token_index[rows], (expert_out[rows] * gate_rows[rows]).to(out_dtype))

        for_each_expert(forward_rows, counts, tokens.device)
        ctx.save_for_backward(token_index, dropped, gate_rows, w1, b1, w_up, b_up, w2, b2, saved.x, saved.pre,
                              saved.up, saved.act, expert_out)
        ctx.counts, ctx.activation, ctx.num_tokens, ctx.gate_dtype = counts, activation, tokens.shape[0], gate.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        token_index, dropped, gate_rows, w1, b1, w_up, b_up, w2, b2, x, pre, up, act, expert_out = ctx.saved_tensors
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, ctx.activation)
        saved = ExpertActivations(x, pre, up, act)
        grad_out = grad_out.contiguous()
        grads = ExpertGradients.empty(weights, ctx.needs_input_grad[3:9])
        grads.zero_experts_without_rows(ctx.counts)
        grad_gate = expert_out.new_empty(token_index.shape[0]) if ctx.needs_input_grad[2] else None
        grad_tokens = None
        if ctx.needs_input_grad[0]:
            grad_tokens = x.new_empty((ctx.num_tokens, x.shape[1]))
            grad_tokens.index_fill_(0, dropped, 0.0)

        def backward_rows(expert: int, rows: slice) -> None:
            grad_y = grad_out.index_select(0, token_index[rows]).to(expert_out.dtype)
            if grad_gate is not None:
                torch.linalg.vecdot(grad_y, expert_out[rows], out=grad_gate[rows])
            grad_y.mul_(gate_rows[rows])
            grad_x = None if grad_tokens is None else x.new_empty(grad_y.shape[0], x.shape[1])
            expert_backward(weights, expert, saved, rows, grad_y, grads, grad_x)
            if grad_x is not None:
                grad_tokens.index_copy_(0, token_index[rows], grad_x)

        for_each_expert(backward_rows, ctx.counts, x.device)
        grad_gate = None if grad_gate is None else grad_gate.to(ctx.gate_dtype)
        return (grad_tokens, None, grad_gate, *grads.as_tuple(), None, None, None)


def token_experts(tokens: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor, counts: list[int],
                  weights: ExpertWeights, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """tokens [N, d] -> [N, d]: y_t = gate[a] * FFN_e(tokens[t]) for the kept assignment a = (t, e), 0 for a token
    without one. ``token_index`` [A] (each token at most once) sorted by expert, ``counts[e]`` of them for expert e;
    ``gate`` [A]. Under autocast the FFN runs in the autocast dtype (as ``F.linear`` would); the output is
    ``out_dtype`` (default: the tokens' dtype)."""
    check_experts(counts, weights)
    if sum(counts) != token_index.shape[0] or gate.shape != token_index.shape:
        raise ValueError(f"the row counts add up to {sum(counts)}; token_index {tuple(token_index.shape)} and gate "
                         f"{tuple(gate.shape)} must both have one entry per kept assignment")
    out_dtype = out_dtype or tokens.dtype
    tokens, weights = autocast_operands(tokens, weights)
    with torch.autocast(tokens.device.type, enabled=False):
        return _TokenExperts.apply(tokens.contiguous(), token_index, gate, weights.w1, weights.b1, weights.w_up,
                                   weights.b_up, weights.w2, weights.b2, counts, weights.activation, out_dtype)
