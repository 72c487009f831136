"""``eager_under_compile``: ``torch.compiler.disable`` applied at the first call made once torch.compile is loaded.

``@torch.compiler.disable`` imports ``torch._dynamo`` when the decorated module is imported: about a second, half
of a command's start-up, paid by commands that never compile (``xscale data``, ``eval``, ``--help``). Nothing can be
compiled before ``torch._dynamo`` is imported, so until then the function runs as it is; from the first call after,
it runs through ``torch.compiler.disable(fn)``, so a compiled caller runs it eagerly, as the decorator would.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Function = TypeVar("Function", bound=Callable[..., Any])


def eager_under_compile(function: Function) -> Function:
    """``function``, never traced by torch.compile, without importing ``torch._dynamo`` before it is needed."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # no torch.compile yet: nothing can trace this call
                return function(*args, **kwargs)
            disabled = torch.compiler.disable(function)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]
