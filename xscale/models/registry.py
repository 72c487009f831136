"""Name -> class registries: a config names a component, the registry builds it.

Adding a variant touches one file (which registers itself) plus its test. Every component module is imported by
``xscale.models`` itself (:mod:`xscale.models.zoo`), so a registry read through any ``xscale.models`` import is
complete. A component's settings are its ``Options`` dataclass (defaults, ranges in ``__post_init__``, a one-line
help per field in ``metadata["help"]``): a config names it as ``{kind: NAME, options: {...}}``
(:class:`~xscale.config.schema.Component`) and :meth:`Registry.options` reads those into the dataclass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from xscale.config.load import from_dict
from xscale.config.schema import Component, ConfigError


@dataclasses.dataclass
class NoOptions:
    """A component without options."""


class Registry:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, *names: str) -> Callable[[Any], Any]:
        def add(obj: Any) -> Any:
            for name in names:
                if name in self._entries:
                    raise KeyError(f"{self.kind} '{name}' is registered twice")
                self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} '{name}'; available: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def options_class(self, name: str) -> type:
        """The ``Options`` dataclass of component ``name`` (:class:`NoOptions` when it has none)."""
        return getattr(self.get(name), "Options", NoOptions)

    def options(self, component: Component, where: str) -> Any:
        """``component``'s options as its ``Options`` dataclass, defaults filled in; an unknown option is refused
        naming the closest and every valid one (``where``: the config key, e.g. ``model.position``)."""
        cls = self.options_class(component.kind)
        if component.options and not dataclasses.fields(cls):
            raise ConfigError(f"{where}: {self.kind} '{component.kind}' takes no options; remove "
                              f"{', '.join(f'{where}.options.{key}' for key in component.options)}")
        return from_dict(cls, component.options, f"{where}.options")

    def build(self, component: Component, where: str, *args: Any, **kwargs: Any) -> Any:
        """The registered class of ``component.kind`` called with ``args``, ``kwargs`` and ``options=`` its parsed
        options."""
        return self.get(component.kind)(*args, options=self.options(component, where), **kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ATTENTION = Registry("attention")
POSITION = Registry("position")
NORM = Registry("norm")
FFN = Registry("ffn")
ROUTER = Registry("router")
STACK = Registry("stack")
BLOCK = Registry("block")
OBJECTIVE_HEAD = Registry("objective_head")
REGISTRIES = {"attention": ATTENTION, "position": POSITION, "norm": NORM, "ffn": FFN, "router": ROUTER,
              "stack": STACK, "block": BLOCK, "objective_head": OBJECTIVE_HEAD}

