"""Name -> class registries: a config names a component, the registry builds it.

Adding a variant touches one file (which registers itself) plus its test. Every component module is imported by
``xscale.models`` itself (:mod:`xscale.models.zoo`), so a registry read through any ``xscale.models`` import is
complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ATTENTION = Registry("attention")
POSITION = Registry("position")
NORM = Registry("norm")
FFN = Registry("ffn")
ROUTER = Registry("router")
REGISTRIES = {"attention": ATTENTION, "position": POSITION, "norm": NORM, "ffn": FFN, "router": ROUTER}

