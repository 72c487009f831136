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

import torch

from xscale.ops.expert_threads import for_each_expert

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


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w_up, b_up, w2, b2, counts, activation):
        rows, hidden = x.shape[0], w1.shape[1]
        gated = w_up is not None
        pre = x.new_empty((rows, hidden))
        up = x.new_empty((rows, hidden)) if gated else None
        act = x.new_empty((rows, hidden))
        y = x.new_empty((rows, w2.shape[1]))

        def expert_forward(expert: int, part: slice) -> None:
            _linear_into(pre[part], x[part], w1[expert], None if b1 is None else b1[expert])
            _activate(pre[part], activation, act[part])
            if gated:
                _linear_into(up[part], x[part], w_up[expert], None if b_up is None else b_up[expert])
                act[part].mul_(up[part])
            _linear_into(y[part], act[part], w2[expert], None if b2 is None else b2[expert])

        for_each_expert(expert_forward, counts, x.device)
        ctx.save_for_backward(x, w1, w_up, w2, pre, up, act)
        ctx.counts, ctx.activation = counts, activation
        ctx.has_bias = (b1 is not None, b_up is not None, b2 is not None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, w_up, w2, pre, up, act = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        counts, gated = ctx.counts, w_up is not None
        grads = {name: (torch.empty_like(weight) if weight is not None and need else None)
                 for name, weight, need in (("w1", w1, ctx.needs_input_grad[1]), ("w_up", w_up, ctx.needs_input_grad[3]),
                                            ("w2", w2, ctx.needs_input_grad[5]))}
        bias_grads = {name: (weight.new_empty(weight.shape[:2]) if has and need else None)
                      for name, weight, has, need in (("b1", w1, ctx.has_bias[0], ctx.needs_input_grad[2]),
                                                      ("b_up", w_up, ctx.has_bias[1], ctx.needs_input_grad[4]),
                                                      ("b2", w2, ctx.has_bias[2], ctx.needs_input_grad[6]))}
        grad_x = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        for expert, count in enumerate(counts):  # an expert without rows gets zero gradients
            if count == 0:
                for grad in (*grads.values(), *bias_grads.values()):
                    if grad is not None:
                        grad[expert].zero_()

        def expert_backward(expert: int, part: slice) -> None:
            n = part.stop - part.start
            g_y, g_h = grad_y[part], x.new_empty((n, w1.shape[1]))  # g_h: the expert's hidden gradient
            if grads["w2"] is not None:
                torch.mm(g_y.t(), act[part], out=grads["w2"][expert])
            if bias_grads["b2"] is not None:
                torch.sum(g_y, dim=0, out=bias_grads["b2"][expert])
            torch.mm(g_y, w2[expert], out=g_h)  # d hidden
            if gated:
                # hidden = act(pre) * up: d up = d hidden * act(pre); d act = d hidden * up
                g_up = _activate(pre[part], ctx.activation, x.new_empty((n, w1.shape[1]))).mul_(g_h)
                g_h.mul_(up[part])
            _activation_backward(g_h, pre[part], ctx.activation)  # g_h is now d pre
            if grads["w1"] is not None:
                torch.mm(g_h.t(), x[part], out=grads["w1"][expert])
            if bias_grads["b1"] is not None:
                torch.sum(g_h, dim=0, out=bias_grads["b1"][expert])
            if gated:
                if grads["w_up"] is not None:
                    torch.mm(g_up.t(), x[part], out=grads["w_up"][expert])
                if bias_grads["b_up"] is not None:
                    torch.sum(g_up, dim=0, out=bias_grads["b_up"][expert])
            if grad_x is not None:
                torch.mm(g_h, w1[expert], out=grad_x[part])
                if gated:
                    grad_x[part].addmm_(g_up, w_up[expert])

        for_each_expert(expert_backward, counts, x.device)
        return (grad_x, grads["w1"], bias_grads["b1"], grads["w_up"], bias_grads["b_up"], grads["w2"],
                bias_grads["b2"], None, None)


def grouped_mlp(x: torch.Tensor, counts: list[int], activation: str, w1: torch.Tensor, b1: torch.Tensor | None,
                w2: torch.Tensor, b2: torch.Tensor | None, w_up: torch.Tensor | None = None,
                b_up: torch.Tensor | None = None) -> torch.Tensor:
    """x [sum(counts), d] sorted by expert -> [sum(counts), d]: expert e's FFN on its ``counts[e]`` rows.

    w1 (and w_up for a gated FFN) [E, hidden, d], w2 [E, d, hidden], biases [E, out] or None. A gated FFN
    (``w_up`` given) computes act(x w1^T) * (x w_up^T) before w2. Under autocast the operands are cast to the
    autocast dtype first, as ``F.linear`` would.
    """
    if len(counts) != w1.shape[0]:
        raise ValueError(f"got row counts for {len(counts)} experts, the weights stack {w1.shape[0]}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"the row counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"unknown activation '{activation}' ({', '.join(ACTIVATION_NAMES)})")
    tensors = [x, w1, b1, w_up, b_up, w2, b2]
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        tensors = [None if t is None else t.to(dtype) for t in tensors]
    x, w1, b1, w_up, b_up, w2, b2 = tensors
    with torch.autocast(device, enabled=False):
        return _GroupedMLP.apply(x.contiguous(), w1, b1, w_up, b_up, w2, b2, counts, activation)
