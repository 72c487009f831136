"""Reversible residual layers (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020 sec. 3); ``model.stack=reversible``.

The stream is duplicated into two halves (x1, x2) = (x, x), as the Reformer does, and each block maps them by

    Y1 = X1 + F(X2)      F: the attention residual branch, dropout(attention(norm(X2)))
    Y2 = X2 + G(Y1)      G: the feed-forward residual branch, dropout(ffn(norm(Y1)))

which is inverted exactly (up to round-off) by X2 = Y2 - G(Y1), X1 = Y1 - F(X2). The stack's output is the
mean (Y1 + Y2) / 2 of the two halves, so the final norm and head keep width d_model (the Reformer concatenates
them; the mean keeps every other module unchanged).

:class:`ReversibleFunction` runs the whole stack without recording a graph and keeps only the last (Y1, Y2);
its backward rebuilds each block's inputs from its outputs, last block first, re-running F and G with autograd
on to get their gradients. Activation memory is therefore one block's, whatever the depth. Dropout replays the
forward's masks: under a positioned :class:`~xscale.runtime.StepContext` they are functions of the position
(:mod:`xscale.models.dropout`); without one torch's generator state before each branch is saved and restored.
The re-run calls the same modules, so a plan's hooks run again in it: tensor parallelism's collectives (with
sequence parallelism) and context parallelism's K/V exchange, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from xscale.config.schema import Config, ConfigError
from xscale.models.position import PositionEncoding
from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack, carrying_kinds
from xscale.models.traits import Refusal, StackTraits
from xscale.runtime import StepContext

Branch = Callable[[torch.Tensor], torch.Tensor]


class _GeneratorState:
    """torch's generator state (CPU, and the device's for a CUDA tensor) before a branch ran, for its replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class ReversibleFunction(torch.autograd.Function):
    """(X1, X2) -> (Y1, Y2) through every block's (F, G), keeping only the outputs for backward (module docstring).

    ``branches``: (F, G) per block in order; ``parameters``: every parameter they read, so their gradients are
    returned as this function's (and reach any hook or ``torch.autograd.grad`` as a plain graph's would).
    """

    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, branches: Sequence[tuple[Branch, Branch]],
                *parameters: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.branches, ctx.parameters, ctx.states = branches, parameters, []
        device_type = x1.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        for f, g in branches:
            before_f = _GeneratorState(x1.device)
            x1 = x1 + f(x2)
            before_g = _GeneratorState(x1.device)
            x2 = x2 + g(x1)
            ctx.states.append((before_f, before_g))
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, grad_y1: torch.Tensor, grad_y2: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y1, y2 = (tensor.detach() for tensor in ctx.saved_tensors)
        totals: list[torch.Tensor | None] = [None] * len(ctx.parameters)
        device_type, dtype, autocast = ctx.autocast
        devices = [y1.device] if device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autocast(device_type, dtype=dtype, enabled=autocast):
            for (f, g), (before_f, before_g) in zip(reversed(ctx.branches), reversed(ctx.states), strict=True):
                y1 = y1.requires_grad_()
                before_g.restore()
                g_y1 = g(y1)  # X2 = Y2 - G(Y1); dL/dY1 gains G's path, dL/dX2 = dL/dY2 so far
                grad_g = torch.autograd.grad(g_y1, (y1, *ctx.parameters), grad_y2, allow_unused=True)
                x2 = (y2 - g_y1.detach()).requires_grad_()
                grad_x1 = grad_y1 + grad_g[0]
                before_f.restore()
                f_x2 = f(x2)  # X1 = Y1 - F(X2); dL/dX2 gains F's path
                grad_f = torch.autograd.grad(f_x2, (x2, *ctx.parameters), grad_x1, allow_unused=True)
                _accumulate(totals, grad_g[1:])
                _accumulate(totals, grad_f[1:])
                y1, y2 = y1.detach() - f_x2.detach(), x2.detach()
                grad_y1, grad_y2 = grad_x1, grad_y2 + grad_f[0]
        return grad_y1, grad_y2, None, *totals


def _accumulate(totals: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for index, grad in enumerate(grads):
        if grad is not None:
            totals[index] = grad if totals[index] is None else totals[index] + grad


def reversible_stack(x: torch.Tensor, branches: Sequence[tuple[Branch, Branch]],
                     parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The reversible stack's output (Y1 + Y2) / 2 from x duplicated into (X1, X2) (module docstring).

    ``parameters``: those the branches read. Without autograd (evaluation, decoding) the same blocks run as a
    plain loop, as nothing needs rebuilding."""
    x1, x2 = x, x
    if torch.is_grad_enabled():
        trained = [parameter for parameter in parameters if parameter.requires_grad]
        x1, x2 = ReversibleFunction.apply(x1, x2, tuple(branches), *trained)
    else:
        for f, g in branches:
            x1 = x1 + f(x2)
            x2 = x2 + g(x1)
    return (x1 + x2) / 2


@STACK.register("reversible")
class ReversibleStack(Stack):
    """The held blocks as reversible residuals: F = the attention branch, G = the feed-forward branch."""

    stack_traits = StackTraits(
        pp=Refusal("a pipeline stage would hold part of the two-half stream and its backward could not rebuild the "
                   "inputs of blocks held elsewhere"),
        zero3=Refusal("FSDP2 gathers a block's parameters in hooks around the block's forward, which the reversible "
                      "backward's re-run branches go around; ZeRO-1/2 work"),
        activation_checkpointing=Refusal("it already recomputes every block in backward"),
    )

    @classmethod
    def check(cls, config: Config, options: object) -> None:
        """Refuse model options the reversible stack cannot invert or replay, each with what to change."""
        model = config.model
        if model.norm_placement in ("post", "deepnorm"):
            raise ConfigError(f"model.stack=reversible needs model.norm_placement=pre, sandwich or rezero: a "
                              f"{model.norm_placement} layer norm(a x + f(x)) cannot be inverted from its output")
        if model.family == "encoder_decoder":
            raise ConfigError("model.stack=reversible supports model.family=decoder or encoder (a decoder block's "
                              "cross-attention is a third branch the two-half scheme has no place for)")
        if carrying := carrying_kinds(model):
            raise ConfigError(f"model.stack=reversible cannot carry attention scores from layer to layer "
                              f"({', '.join(carrying)}: RealFormer); choose another model.attention.kind")
        if model.moe.num_experts:
            raise ConfigError("model.stack=reversible with MoE (model.moe.num_experts > 0) is not supported: the "
                              "recomputed routing would record its load metrics twice; set model.stack=plain or "
                              "model.moe.num_experts=0")

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        branches = []
        for depth, block in zip(self.depths, self.blocks()):
            block_context = self.block_context(depth, context)
            branches.append((
                lambda h, block=block, c=block_context: block.attention.branch(h, position, context=c),
                lambda h, block=block, c=block_context: block.feed_forward.branch(h, context=c)))
        return reversible_stack(x, branches, list(self.parameters())), scores
