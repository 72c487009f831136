"""A process-wide value set for the duration of a ``with`` block: where the batch in flight sits (dropout masks,
router noise), the token ids hash routing reads, a pipeline stage's decoder ids.

A global, not a ContextVar: autograd's device threads read it too. A scope is re-enterable, so activation
checkpointing can replay one for every recomputation (zero-bubble schedules split a backward in two). Each value
says what a recomputation needs of it (``recomputation``), so checkpointing re-enters them all through
:func:`recomputation_scopes` without knowing the components that read them.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Recomputation = Literal["replay", "store"]


class ScopedValue(Generic[T]):
    """``with value.scope(x):`` makes ``value.current`` x inside the block (None outside every scope).

    ``recomputation``: what activation checkpointing enters around the forward it recomputes: ``replay``, the
    value that forward saw (where the batch sits, its token ids); ``store``, a fresh dict per checkpointed forward,
    entered around the forward and its recomputation alike (the forward fills it, the recomputation reads it).
    """

    def __init__(self, recomputation: Recomputation | None = None) -> None:
        self.current: T | None = None
        if recomputation is not None:
            _RECOMPUTED.append((self, recomputation))

    def scope(self, value: T | None) -> Scope[T]:
        return Scope(self, value)


class Scope(Generic[T]):
    """One setting of a :class:`ScopedValue`; entering it again nests (the previous value comes back on exit)."""

    def __init__(self, owner: ScopedValue[T], value: T | None) -> None:
        self.owner, self.value = owner, value
        self._previous: list[T | None] = []

    def __enter__(self) -> None:
        self._previous.append(self.owner.current)
        self.owner.current = self.value

    def __exit__(self, *exc_info: object) -> None:
        self.owner.current = self._previous.pop()


class Scopes:
    """Several scopes entered together, in order (re-enterable like each of them)."""

    def __init__(self, scopes: list[Scope]) -> None:
        self.scopes = scopes

    def __enter__(self) -> None:
        for scope in self.scopes:
            scope.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        for scope in reversed(self.scopes):
            scope.__exit__(*exc_info)


_RECOMPUTED: list[tuple[ScopedValue, Recomputation]] = []


def recomputation_scopes() -> tuple[Scopes, Scopes]:
    """For one forward that activation checkpointing will recompute, called as it starts: (the scopes entered
    around the forward, those entered around its recomputation), so that the recomputation sees what it saw."""
    stores = [value.scope({}) for value, recomputation in _RECOMPUTED if recomputation == "store"]
    replays = [value.scope(value.current) for value, recomputation in _RECOMPUTED if recomputation == "replay"]
    return Scopes(stores), Scopes(replays + stores)
