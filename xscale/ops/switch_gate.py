"""Switch's top-1 gate in one autograd node: logits, softmax, top-1 pick and both auxiliary-loss statistics.

For n tokens x [n, d] and a router W [E, d] (Fedus et al. 2021, eq. 1-2): l = x W^T, p = softmax(l),
e_t = argmax_e p_te and the gate g_t = p_t,e_t; the load-balancing loss reads the column sums P = sum_t p_t
(eq. 4) and the z-loss logsumexp(l_t) (ST-MoE eq. 5). Autograd over the composite (logsumexp, exp, max, the
sums) builds some twenty small nodes whose backward, on a CPU, costs as much as the router's GEMMs: the
layer's step at ``xscale bench moe``'s shape ran 5.1 ms (5%) slower with the router in the graph than with it
detached. Here the backward is written out. With dP (the aux loss's gradient per expert), dz_t (logsumexp's)
and dg_t (the gate's):

    dl_te = p_te (dP_e - c_t + dz_t) + [e = e_t] g_t dg_t,   c_t = sum_e p_te dP_e + g_t dg_t,

then dx = dl W and dW = dl^T x (dx added in place into the experts' input gradient when they leave theirs in a
:class:`xscale.ops.shared_input_gradient.SharedInputGradient`). The [n, E] work runs on the transposed [E, n] layout (reductions over the few
experts become passes along contiguous rows) and on one thread: the team wake-ups of an intra-op parallel
region cost more than the few hundred KiB these passes touch. The GEMMs keep every thread.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from xscale.ops.intra_op_threads import intra_op_threads
from xscale.ops.shared_input_gradient import SharedInputGradient

ONE_THREAD_ELEMENTS = 1 << 20  # [E, n] passes below this size run on one intra-op thread (CPU)


class SwitchGate(NamedTuple):
    gate: torch.Tensor  # [n] float32 (float64 for a float64 router): p_t,e_t
    expert: torch.Tensor  # [n] long: e_t = argmax_e l_te (the first on ties)
    prob_sum: torch.Tensor  # [E], as ``gate``: sum over the n tokens of p_te
    log_normaliser: torch.Tensor  # [n], as ``gate``: logsumexp_e l_te
    input_gradient: SharedInputGradient | None  # where a later reader of x may leave its gradient (x needs one)


def _small_work_threads(elements: int, device: torch.device) -> contextlib.AbstractContextManager:
    """One intra-op thread for a CPU pass over fewer than ``ONE_THREAD_ELEMENTS`` elements."""
    small = device.type == "cpu" and elements < ONE_THREAD_ELEMENTS
    return intra_op_threads(1) if small else contextlib.nullcontext()


class _SwitchGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, input_gradient: SharedInputGradient | None):
        logits = torch.mm(x, weight.t())
        with _small_work_threads(logits.numel(), logits.device):
            by_expert = logits.t().to(torch.promote_types(logits.dtype, torch.float32)).contiguous()  # [E, n]
            top, expert = by_expert.max(0)
            probs = torch.sub(by_expert, top).exp_()
            total = probs.sum(0)
            probs.div_(total)
            gate = probs.gather(0, expert.unsqueeze(0)).squeeze(0)  # exp(0) / total: the max of the row
            log_normaliser = total.log().add_(top)
            prob_sum = probs.sum(1)
        ctx.save_for_backward(x, weight, probs, expert, gate)
        ctx.mark_non_differentiable(expert)
        ctx.input_gradient = input_gradient
        return gate, expert, prob_sum, log_normaliser

    @staticmethod
    def backward(ctx, grad_gate, _grad_expert, grad_prob_sum, grad_log_normaliser):
        x, weight, probs, expert, gate = ctx.saved_tensors
        num_experts, n = probs.shape
        with _small_work_threads(probs.numel(), probs.device):
            gated = gate * grad_gate if grad_gate is not None else gate.new_zeros(n)
            per_expert = grad_prob_sum if grad_prob_sum is not None else probs.new_zeros(num_experts)
            per_token = torch.mv(probs.t(), per_expert).add_(gated).neg_()  # -c_t
            if grad_log_normaliser is not None:
                per_token.add_(grad_log_normaliser)
            grad_logits = probs * (per_expert.unsqueeze(1) + per_token)  # [E, n]
            grad_logits.scatter_add_(0, expert.unsqueeze(0), gated.unsqueeze(0))
            grad_logits = grad_logits.to(x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            left = None if ctx.input_gradient is None else ctx.input_gradient.take()
            grad_x = torch.mm(grad_logits.t(), weight) if left is None else left.addmm_(grad_logits.t(), weight)
        grad_weight = torch.mm(grad_logits, x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def switch_gate(x: torch.Tensor, weight: torch.Tensor) -> SwitchGate:
    """Top-1 routing of the rows of x [n, d] by the router ``weight`` [E, d] (same dtype; see the module docstring)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"switch_gate takes x [n, d] and weight [E, d]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    input_gradient = SharedInputGradient(x) if x.requires_grad else None
    return SwitchGate(*_SwitchGate.apply(x, weight, input_gradient), input_gradient)
