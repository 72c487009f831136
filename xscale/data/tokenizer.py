"""The face every tokenizer shows the data pipeline and the objectives, and the special-token names they share.

Kinds, one file each: SentencePiece (:mod:`xscale.data.sentencepiece_tokenizer`), Hugging Face ``tokenizer.json``
(:mod:`xscale.data.hf_tokenizer`), tiktoken encodings (:mod:`xscale.data.tiktoken_tokenizer`) and the closed
vocabulary of the synthetic tasks (:mod:`xscale.data.fixed_vocab`); :mod:`xscale.data.load_tokenizer` picks one
by path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

MASK_PIECE = "<mask>"
DEFAULT_SENTINELS = 100


def sentinel_piece(index: int) -> str:
    """T5's name for the index-th span sentinel."""
    return f"<extra_id_{index}>"


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids plus the special ids the objectives need (``mask_id`` is None and ``sentinel_ids`` empty when
    the vocabulary lacks them; the objective that needs them says so)."""

    path: str | None  # the file it was loaded from (copied into every checkpoint), None when built in memory

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def unk_id(self) -> int | None: ...

    @property
    def mask_id(self) -> int | None: ...

    @property
    def sentinel_ids(self) -> list[int]: ...

    @property
    def special_ids(self) -> list[int]:
        """Ids that are never masked or drawn as random replacements."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
