"""Grouped expert FFN: every expert's whole FFN on its own rows, one expert at a time, forward and backward.

For rows sorted by expert (``counts[e]`` rows for expert e, variable sizes: dropless-capable):

    MLP:        y_e = act(x_e W1_e^T + b1_e) W2_e^T + b2_e
    gated MLP:  y_e = (act(x_e Wg_e^T + bg_e) * (x_e Wu_e^T + bu_e)) W2_e^T + b2_e   (Shazeer 2020, GLU variants)

Three grouped linears and an activation as separate autograd nodes would each sweep the whole [rows, hidden]
activation through memory once per pass; here an expert's hidden slice (``counts[e]`` x hidden) is produced,
activated and consumed while it is in cache, and the backward keeps an expert-sized scratch buffer for the
hidden gradient instead of two full-size ones. On CPU the experts run side by side on the threads
(:func:`xscale.ops.expert_threads.for_each_expert`). Saved for backward: x, the pre-activation(s) and the hidden
activation, as autograd would save them. The arithmetic is the unfused one, op for op (tested to 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xscale.ops.expert_threads import for_each_expert
from xscale.runtime.eager import eager_under_compile

aten = torch.ops.aten
ACTIVATION_NAMES = ("gelu", "gelu_tanh", "silu", "relu")


def _activate(pre: torch.Tensor, activation: str, out: torch.Tensor) -> torch.Tensor:
    if activation == "gelu":
        return aten.gelu.out(pre, approximate="none", out=out)
    if activation == "gelu_tanh":
        return aten.gelu.out(pre, approximate="tanh", out=out)
    if activation == "silu":
        return aten.silu.out(pre, out=out)
    if activation == "relu":
        return torch.clamp(pre, min=0, out=out)
    raise ValueError(f"unknown activation '{activation}' (gelu, gelu_tanh, silu, relu)")


def _activation_backward(grad: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(pre) / d pre * grad, written into ``grad``."""
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return aten.gelu_backward.grad_input(grad, pre, approximate=approximate, grad_input=grad)
    if activation == "silu":
        return aten.silu_backward.grad_input(grad, pre, grad_input=grad)
    if activation == "relu":
        return grad.masked_fill_(pre <= 0, 0.0)
    raise ValueError(f"unknown activation '{activation}' (gelu, gelu_tanh, silu, relu)")


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = x weight^T (+ bias)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


@dataclass(frozen=True)
class ExpertWeights:
    """The stacked weights of E expert FFNs: w1 (and w_up, gated) [E, hidden, d], w2 [E, d, hidden], biases [E, out]
    or None, and the activation."""

    w1: torch.Tensor
    b1: torch.Tensor | None
    w_up: torch.Tensor | None
    b_up: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    activation: str

    @property
    def gated(self) -> bool:
        return self.w_up is not None

    @property
    def hidden(self) -> int:
        return self.w1.shape[1]


@dataclass(frozen=True)
class ExpertActivations:
    """What an expert's backward reads, one row per routed token: the input x, the pre-activation(s) and the hidden
    activation, as autograd would save them."""

    x: torch.Tensor
    pre: torch.Tensor
    up: torch.Tensor | None
    act: torch.Tensor

    @staticmethod
    def empty(x: torch.Tensor, weights: ExpertWeights) -> ExpertActivations:
        rows = (x.shape[0], weights.hidden)
        return ExpertActivations(x, x.new_empty(rows), x.new_empty(rows) if weights.gated else None, x.new_empty(rows))


def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def expert_forward(weights: ExpertWeights, expert: int, saved: ExpertActivations, rows: slice,
                   y: torch.Tensor) -> None:
    """y = expert ``expert``'s FFN of ``saved.x[rows]``, its activations written into ``saved``'s rows."""
    x, pre, act = saved.x[rows], saved.pre[rows], saved.act[rows]
    _linear_into(pre, x, weights.w1[expert], _bias(weights.b1, expert))
    _activate(pre, weights.activation, act)
    if weights.gated:
        up = saved.up[rows]
        _linear_into(up, x, weights.w_up[expert], _bias(weights.b_up, expert))
        act.mul_(up)
    _linear_into(y, act, weights.w2[expert], _bias(weights.b2, expert))


@dataclass(frozen=True)
class ExpertGradients:
    """Gradient buffers of the stacked weights (None: not wanted), filled expert by expert."""

    w1: torch.Tensor | None
    b1: torch.Tensor | None
    w_up: torch.Tensor | None
    b_up: torch.Tensor | None
    w2: torch.Tensor | None
    b2: torch.Tensor | None

    @staticmethod
    def empty(weights: ExpertWeights, wanted: tuple[bool, ...]) -> ExpertGradients:
        """``wanted``: (w1, b1, w_up, b_up, w2, b2) as autograd's needs_input_grad lists them."""
        tensors = (weights.w1, weights.b1, weights.w_up, weights.b_up, weights.w2, weights.b2)
        return ExpertGradients(*(torch.empty_like(t) if t is not None and need else None
                                 for t, need in zip(tensors, wanted)))

    def as_tuple(self) -> tuple[torch.Tensor | None, ...]:
        return self.w1, self.b1, self.w_up, self.b_up, self.w2, self.b2

    def zero_experts_without_rows(self, counts: list[int]) -> None:
        for expert, count in enumerate(counts):
            if count == 0:
                for grad in self.as_tuple():
                    if grad is not None:
                        grad[expert].zero_()


def expert_backward(weights: ExpertWeights, expert: int, saved: ExpertActivations, rows: slice, grad_y: torch.Tensor,
                    grads: ExpertGradients, grad_x: torch.Tensor | None) -> None:
    """Expert ``expert``'s weight gradients from ``grad_y`` (its rows' output gradients) into ``grads``, and the
    input gradient into ``grad_x`` (None: not wanted). The hidden gradient lives in an expert-sized scratch."""
    x, pre, act = saved.x[rows], saved.pre[rows], saved.act[rows]
    g_h = x.new_empty((x.shape[0], weights.hidden))
    if grads.w2 is not None:
        torch.mm(grad_y.t(), act, out=grads.w2[expert])
    if grads.b2 is not None:
        torch.sum(grad_y, dim=0, out=grads.b2[expert])
    torch.mm(grad_y, weights.w2[expert], out=g_h)  # d hidden
    if weights.gated:
        # hidden = act(pre) * up: d up = d hidden * act(pre); d act = d hidden * up
        g_up = _activate(pre, weights.activation, x.new_empty(g_h.shape)).mul_(g_h)
        g_h.mul_(saved.up[rows])
    _activation_backward(g_h, pre, weights.activation)  # g_h is now d pre
    if grads.w1 is not None:
        torch.mm(g_h.t(), x, out=grads.w1[expert])
    if grads.b1 is not None:
        torch.sum(g_h, dim=0, out=grads.b1[expert])
    if weights.gated:
        if grads.w_up is not None:
            torch.mm(g_up.t(), x, out=grads.w_up[expert])
        if grads.b_up is not None:
            torch.sum(g_up, dim=0, out=grads.b_up[expert])
    if grad_x is not None:
        torch.mm(g_h, weights.w1[expert], out=grad_x)
        if weights.gated:
            grad_x.addmm_(g_up, weights.w_up[expert])


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w_up, b_up, w2, b2, counts, activation):
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, activation)
        saved = ExpertActivations.empty(x, weights)
        y = x.new_empty((x.shape[0], w2.shape[1]))
        for_each_expert(lambda expert, rows: expert_forward(weights, expert, saved, rows, y[rows]), counts, x.device)
        ctx.save_for_backward(x, w1, b1, w_up, b_up, w2, b2, saved.pre, saved.up, saved.act)
        ctx.counts, ctx.activation = counts, activation
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, b1, w_up, b_up, w2, b2, pre, up, act = ctx.saved_tensors
        weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, ctx.activation)
        saved = ExpertActivations(x, pre, up, act)
        grad_y = grad_y.contiguous()
        grads = ExpertGradients.empty(weights, ctx.needs_input_grad[1:7])
        grads.zero_experts_without_rows(ctx.counts)
        grad_x = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None

        def backward_rows(expert: int, rows: slice) -> None:
            expert_backward(weights, expert, saved, rows, grad_y[rows], grads,
                            None if grad_x is None else grad_x[rows])

        for_each_expert(backward_rows, ctx.counts, x.device)
        return (grad_x, *grads.as_tuple(), None, None)


@eager_under_compile  # eager in a compiled block too: the experts run on worker threads, which dynamo cannot trace
def grouped_mlp(x: torch.Tensor, counts: list[int], activation: str, w1: torch.Tensor, b1: torch.Tensor | None,
                w2: torch.Tensor, b2: torch.Tensor | None, w_up: torch.Tensor | None = None,
                b_up: torch.Tensor | None = None) -> torch.Tensor:
    """x [sum(counts), d] sorted by expert -> [sum(counts), d]: expert e's FFN on its ``counts[e]`` rows.

    w1 (and w_up for a gated FFN) [E, hidden, d], w2 [E, d, hidden], biases [E, out] or None. A gated FFN
    (``w_up`` given) computes act(x w1^T) * (x w_up^T) before w2. Under autocast the operands are cast to the
    autocast dtype first, as ``F.linear`` would.
    """
    weights = ExpertWeights(w1, b1, w_up, b_up, w2, b2, activation)
    check_experts(counts, weights)
    if sum(counts) != x.shape[0]:
        raise ValueError(f"the row counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    x, weights = autocast_operands(x, weights)
    with torch.autocast(x.device.type, enabled=False):
        return _GroupedMLP.apply(x.contiguous(), weights.w1, weights.b1, weights.w_up, weights.b_up, weights.w2,
                                 weights.b2, counts, activation)


def check_experts(counts: list[int], weights: ExpertWeights) -> None:
    """One row count per stacked expert and a known activation, or a ValueError naming what is wrong."""
    if len(counts) != weights.w1.shape[0]:
        raise ValueError(f"got row counts for {len(counts)} experts, the weights stack {weights.w1.shape[0]}")
    if weights.activation not in ACTIVATION_NAMES:
        raise ValueError(f"unknown activation '{weights.activation}' ({', '.join(ACTIVATION_NAMES)})")


def autocast_operands(x: torch.Tensor, weights: ExpertWeights) -> tuple[torch.Tensor, ExpertWeights]:
    """Under autocast, x and the weights cast to the autocast dtype first, as ``F.linear`` would; else as they are."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weights
    dtype = torch.get_autocast_dtype(device)
    tensors = [None if t is None else t.to(dtype) for t in (weights.w1, weights.b1, weights.w_up, weights.b_up,
                                                                weights.w2, weights.b2)]
    return x.to(dtype), ExpertWeights(*tensors, weights.activation)
