"""``skip_meta_init``: the weight initialisation modules run in their constructors, skipped on meta tensors.

A model is built on the meta device (shapes only) and initialised once materialised (:func:`xscale.models.build_model`),
so what its constructors' ``reset_parameters`` do to meta tensors is lost anyway. It is not free: torch 2.13 runs
``normal_`` on a meta tensor through a Python reference that imports ``torch._dynamo`` at its first call, seconds of
the start-up of every command that builds a model and never compiles.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class skip_meta_init(TorchFunctionMode):  # noqa: N801  (used as a context manager, like torch.device)
    """Inside it, ``torch.nn.init``'s in-place functions and ``Tensor.normal_`` return a meta tensor untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        if isinstance(tensor, torch.Tensor) and tensor.is_meta and (func is torch.Tensor.normal_ or _initialises(func)):
            return tensor
        return func(*args, **kwargs)


def _initialises(func) -> bool:
    """One of ``torch.nn.init``'s in-place initialisers (``normal_``, ``kaiming_uniform_``, ...), which return the
    tensor they fill."""
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_") and not name.startswith("_")
