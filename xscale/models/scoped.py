"""A process-wide value set for the duration of a ``with`` block: where the batch in flight sits (dropout masks,
router noise), the token ids hash routing reads, a pipeline stage's decoder ids.

A global, not a ContextVar: autograd's device threads read it too. A scope is re-enterable, so activation
checkpointing can replay one for every recomputation (zero-bubble schedules split a backward in two).
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ScopedValue(Generic[T]):
    """``with value.scope(x):`` makes ``value.current`` x inside the block (None outside every scope)."""

    def __init__(self) -> None:
        self.current: T | None = None

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
