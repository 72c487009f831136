"""The plain stack: each block applied once, in order (Vaswani et al. 2017); ``model.stack=plain``, the default."""

from __future__ import annotations

from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack


@STACK.register("plain")
class PlainStack(Stack):
    """x <- block_l(x) for l = 1..L (:meth:`Stack.run`); every layout takes it."""
