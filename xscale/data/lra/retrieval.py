"""Byte-level matching, standing in for LRA's AAN retrieval (Tay et al. 2021, sec. 3.3): two byte documents joined
by <sep>, label 1 when both were written by the same source, 0 when by two different sources.

A source is a byte bigram process over a small alphabet with its own random transition weights (drawn from the
task's ``source_seed``, so every example of a task shares the same sources); telling two sources apart needs
statistics gathered over both whole documents, as comparing two papers' encodings does in LRA.
"""

from __future__ import annotations

import random

from xscale.data.fixed_vocab import FixedVocab

ALPHABET = bytes(range(ord("a"), ord("z") + 1)) + b" .,;:-'()"


class ByteSource:
    """A bigram process: next byte ~ weights[previous byte], sharp (weights u^4 with u uniform)."""

    def __init__(self, rng: random.Random, sharpness: float = 4.0) -> None:
        self.weights = [[rng.random() ** sharpness for _ in ALPHABET] for _ in ALPHABET]

    def write(self, rng: random.Random, length: int) -> bytes:
        current = rng.randrange(len(ALPHABET))
        out = []
        for _ in range(length):
            current = rng.choices(range(len(ALPHABET)), weights=self.weights[current])[0]
            out.append(ALPHABET[current])
        return bytes(out)


class RetrievalTask:
    """``doc_1 <sep> doc_2`` (bytes as tokens), each document (seq_len - 1) // 2 bytes; classes 0 (different
    sources) and 1 (same source), balanced."""

    num_classes = 2

    def __init__(self, seq_len: int, num_sources: int = 8, source_seed: int = 0, sharpness: float = 4.0) -> None:
        self.vocab = FixedVocab([f"x{byte:02x}" for byte in range(256)])
        self.doc_length = (seq_len - 1) // 2
        if self.doc_length < 1 or num_sources < 2:
            raise ValueError(f"retrieval: seq_len={seq_len} must be >= 3 and num_sources={num_sources} >= 2")
        sources_rng = random.Random(source_seed)
        self.sources = [ByteSource(sources_rng, sharpness) for _ in range(num_sources)]

    def byte_tokens(self, data: bytes) -> list[int]:
        return [self.vocab.first_symbol_id + byte for byte in data]

    def example(self, rng: random.Random) -> tuple[list[int], int]:
        first = rng.randrange(len(self.sources))
        same = rng.random() < 0.5
        second = first if same else rng.choice([s for s in range(len(self.sources)) if s != first])
        documents = [self.sources[index].write(rng, self.doc_length) for index in (first, second)]
        return self.byte_tokens(documents[0]) + [self.vocab.sep_id] + self.byte_tokens(documents[1]), int(same)
