"""A closed vocabulary for the synthetic tasks: one token per symbol, xscale's special tokens first."""

from __future__ import annotations

from collections.abc import Sequence

from xscale.data.tokenizer import MASK_PIECE


class FixedVocab:
    """A closed vocabulary (one token per symbol) for the synthetic tasks: specials first, then ``symbols``."""

    SPECIALS = ("<pad>", "<unk>", "<s>", "</s>", MASK_PIECE, "<sep>")

    def __init__(self, symbols: Sequence[str]) -> None:
        self.pieces = list(self.SPECIALS) + list(symbols)
        if len(set(self.pieces)) != len(self.pieces):
            raise ValueError("FixedVocab symbols must be distinct and differ from the special tokens")
        self.ids = {piece: index for index, piece in enumerate(self.pieces)}
        self.pad_id, self.unk_id, self.bos_id, self.eos_id, self.mask_id, self.sep_id = range(len(self.SPECIALS))
        self.sentinel_ids: list[int] = []
        self.first_symbol_id = len(self.SPECIALS)
        self.path: str | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def special_ids(self) -> list[int]:
        return list(range(self.first_symbol_id))

    def encode(self, text: str) -> list[int]:
        """Whitespace-separated symbols to ids."""
        return [self.ids.get(piece, self.unk_id) for piece in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.pieces[int(i)] for i in ids)
