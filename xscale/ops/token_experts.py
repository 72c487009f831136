"""Top-1 experts by token: dispatch, expert FFN and gated combine in one pass per expert (GShard / Switch).

With at most one kept assignment per token (top-1), the MoE layer's y_t = g_t FFN_e(t)(x_t) (0 for a dropped token)
touches every token row once. Gathering all routed rows, running the experts and scattering the weighted outputs
back as three passes over the (tokens, d) activations costs as much as a GEMM's worth of memory traffic on a CPU;
here each expert gathers its own rows, runs its FFN (:mod:`xscale.ops.grouped_mlp`) and weighs them by the gates
into a buffer in expert order while they are in cache, the experts side by side on the CPU threads
(:func:`xscale.ops.expert_threads.for_each_expert`); one gather by each token's row (a zero row for a dropped token)
then puts them in token order. ATen's ``index_copy_`` scatter of each expert's rows to its tokens cost more than that
gather: 1.27-1.29x the dense FFN's step against 1.24-1.26x (``xscale bench moe``'s shape, two runs, same outputs to the
bit). The backward mirrors it: each expert gathers its rows' output gradients, takes d g = <dy, FFN(x)> and g dy, and
writes its input gradients in expert order; one gather puts them in token order.
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
from xscale.ops.moe_permute import assignment_of_token
from xscale.ops.shared_input_gradient import SharedInputGradient
from xscale.runtime.eager import eager_under_compile


class _TokenExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, token_index, gate, w1, b1, w_up, b_up, w2, b2, counts, activation, out_dtype,
                input_gradient):
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, activation)
        assigned = token_index.shape[0]
        saved = ExpertActivations.empty(tokens.new_empty((assigned, tokens.shape[1])), weights)
        expert_out = tokens.new_empty((assigned, w2.shape[1]))
        weighted = tokens.new_empty((assigned + 1, w2.shape[1]))
        weighted[assigned].zero_()
        gate_rows = gate.to(tokens.dtype).unsqueeze(-1)

        def forward_rows(expert: int, rows: slice) -> None:
            torch.index_select(tokens, 0, token_index[rows], out=saved.x[rows])
            expert_forward(weights, expert, saved, rows, expert_out[rows])
            torch.mul(expert_out[rows], gate_rows[rows], out=weighted[rows])

        for_each_expert(forward_rows, counts, tokens.device)
        slot = assignment_of_token(token_index, tokens.shape[0])
        out = weighted.index_select(0, slot).to(out_dtype)
        ctx.save_for_backward(token_index, slot, gate_rows, w1, b1, w_up, b_up, w2, b2, saved.x, saved.pre,
                              saved.up, saved.act, expert_out)
        ctx.counts, ctx.activation, ctx.gate_dtype = counts, activation, gate.dtype
        ctx.input_gradient = input_gradient
        return out

    @staticmethod
    def backward(ctx, grad_out):
        token_index, slot, gate_rows, w1, b1, w_up, b_up, w2, b2, x, pre, up, act, expert_out = ctx.saved_tensors
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, ctx.activation)
        saved = ExpertActivations(x, pre, up, act)
        grad_out = grad_out.contiguous()
        grads = ExpertGradients.empty(weights, ctx.needs_input_grad[3:9])
        grads.zero_experts_without_rows(ctx.counts)
        grad_gate = expert_out.new_empty(token_index.shape[0]) if ctx.needs_input_grad[2] else None
        assigned = token_index.shape[0]
        grad_sorted = x.new_empty((assigned + 1, x.shape[1]))
        grad_sorted[assigned].zero_()

        def backward_rows(expert: int, rows: slice) -> None:
            grad_y = grad_out.index_select(0, token_index[rows]).to(expert_out.dtype)
            if grad_gate is not None:
                torch.linalg.vecdot(grad_y, expert_out[rows], out=grad_gate[rows])
            grad_y.mul_(gate_rows[rows])
            expert_backward(weights, expert, saved, rows, grad_y, grads, grad_sorted[rows])

        for_each_expert(backward_rows, ctx.counts, x.device)
        grad_tokens = grad_sorted.index_select(0, slot) if ctx.needs_input_grad[0] else None
        grad_gate = None if grad_gate is None else grad_gate.to(ctx.gate_dtype)
        if grad_tokens is not None and ctx.input_gradient is not None:  # the router adds its own and returns both
            ctx.input_gradient.leave(grad_tokens)
            grad_tokens = None
        return (grad_tokens, None, grad_gate, *grads.as_tuple(), None, None, None, None)


@eager_under_compile  # eager in a compiled block too: the experts run on worker threads, which dynamo cannot trace
def token_experts(tokens: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor, counts: list[int],
                  weights: ExpertWeights, out_dtype: torch.dtype | None = None,
                  input_gradient: SharedInputGradient | None = None) -> torch.Tensor:
    """tokens [N, d] -> [N, d]: y_t = gate[a] * FFN_e(tokens[t]) for the kept assignment a = (t, e), 0 for a token
    without one. ``token_index`` [A] (each token at most once) sorted by expert, ``counts[e]`` of them for expert e;
    ``gate`` [A]. Under autocast the FFN runs in the autocast dtype (as ``F.linear`` would); the output is
    ``out_dtype`` (default: the tokens' dtype). ``input_gradient``: the router's, when it reads the same rows
    (:mod:`xscale.ops.shared_input_gradient`): the tokens' gradient is left there for the router's backward, which
    gate-dependence runs after this one's."""
    check_experts(counts, weights)
    if sum(counts) != token_index.shape[0] or gate.shape != token_index.shape:
        raise ValueError(f"the row counts add up to {sum(counts)}; token_index {tuple(token_index.shape)} and gate "
                         f"{tuple(gate.shape)} must both have one entry per kept assignment")
    out_dtype = out_dtype or tokens.dtype
    tokens, weights = autocast_operands(tokens, weights)
    tokens = tokens.contiguous()
    if input_gradient is not None and not input_gradient.serves(tokens):
        input_gradient = None  # the router read other rows (a cast or jittered copy): autograd sums the two
    with torch.autocast(tokens.device.type, enabled=False):
        return _TokenExperts.apply(tokens, token_index, gate, weights.w1, weights.b1, weights.w_up,
                                   weights.b_up, weights.w2, weights.b2, counts, weights.activation, out_dtype,
                                   input_gradient)
