"""Token files in Megatron-LM's indexed format (``PREFIX.bin`` + ``PREFIX.idx``), through megatron-core.

Writing and reading go through ``megatron.core.datasets.indexed_dataset`` itself, so corpora users
already preprocessed for Megatron load unchanged and ours load in Megatron. Before megatron-core maps a
file, the index is checked against the layout it documents (header, version, dtype code, counts, sizes)
so a truncated or foreign file gives an error naming the file and the fix instead of a numpy traceback.
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

INDEX_HEADER = b"MMIDIDX\x00\x00"
# Megatron's dtype codes (megatron.core.datasets.indexed_dataset.DType) and their item sizes.
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 4, 7: 8, 8: 2}
_FIXED_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8


class IndexedDataError(ValueError):
    """A .bin/.idx pair that cannot be read; the message names the file and how to rebuild it."""


def _megatron():
    try:
        with warnings.catch_warnings():  # megatron-core's notes on Transformer Engine and Apex: not used here
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as error:
        raise ImportError("reading and writing .bin/.idx token files needs megatron-core: "
                          "pip install megatron-core (a dependency of xscale's base install)") from error
    return indexed_dataset


def _rebuild_hint(prefix: str) -> str:
    return f"re-create it with `xscale data preprocess --input TEXT --tokenizer MODEL --output {prefix}`"


def write_indexed(prefix: str | os.PathLike, documents: Iterable[Iterable[int]], vocab_size: int) -> str:
    """Write token documents (one sequence per document) as ``prefix.bin``/``prefix.idx``; returns the prefix."""
    indexed_dataset = _megatron()
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = indexed_dataset.IndexedDatasetBuilder(
        prefix + ".bin", dtype=indexed_dataset.DType.optimal_dtype(vocab_size))
    for document in documents:
        builder.add_item(torch.as_tensor(np.asarray(document, dtype=np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def check_indexed(prefix: str | os.PathLike) -> None:
    """Raise IndexedDataError unless ``prefix.idx`` and ``prefix.bin`` are a complete, consistent pair."""
    prefix = str(prefix)
    idx_path, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise IndexedDataError(f"{path} does not exist (data.path should be the prefix without .bin/.idx); "
                                   f"{_rebuild_hint(prefix)}")
    with idx_path.open("rb") as stream:
        head = stream.read(_FIXED_HEADER_BYTES)
    if len(head) < _FIXED_HEADER_BYTES or head[:len(INDEX_HEADER)] != INDEX_HEADER:
        raise IndexedDataError(f"{idx_path} is not a Megatron index (bad or short header); {_rebuild_hint(prefix)}")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_HEADER):])
    if version != 1 or code not in _DTYPE_SIZES:
        raise IndexedDataError(f"{idx_path} has index version {version} / dtype code {code}, expected version 1 "
                               f"and a code in {sorted(_DTYPE_SIZES)}; {_rebuild_hint(prefix)}")
    expected = _FIXED_HEADER_BYTES + sequences * (4 + 8) + documents * 8
    actual = idx_path.stat().st_size
    if actual not in (expected, expected + sequences):  # + one mode byte per sequence when multimodal
        raise IndexedDataError(f"{idx_path} is truncated or corrupt: {actual} bytes, but its header promises "
                               f"{sequences} sequences and {documents} document boundaries ({expected} bytes); "
                               f"{_rebuild_hint(prefix)}")
    with idx_path.open("rb") as stream:
        stream.seek(_FIXED_HEADER_BYTES)
        lengths = np.frombuffer(stream.read(sequences * 4), dtype=np.int32)
    needed = int(lengths.sum(dtype=np.int64)) * _DTYPE_SIZES[code]
    if bin_path.stat().st_size != needed:
        raise IndexedDataError(f"{bin_path} holds {bin_path.stat().st_size} bytes but {idx_path} describes "
                               f"{needed}; the pair is truncated or mismatched; {_rebuild_hint(prefix)}")


def open_indexed(prefix: str | os.PathLike):
    """megatron-core's ``IndexedDataset`` for ``prefix``, after :func:`check_indexed`."""
    check_indexed(prefix)
    return _megatron().IndexedDataset(str(prefix))


class IndexedTokens:
    """All sequences of an indexed dataset read as one token stream (the layout Megatron's GPTDataset packs)."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.dataset = open_indexed(prefix)
        lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def max_token(self, vocab_size: int | None = None, chunk: int = 1 << 24) -> int:
        """The largest token id in the file (the vocabulary the model needs is at least this + 1), after checking
        that no id is negative or, with ``vocab_size``, outside the tokenizer's vocabulary."""
        prefix = self.dataset.path_prefix
        tokens = np.memmap(prefix + ".bin", dtype=self.dataset.index.dtype, mode="r")
        pieces = [tokens[start:start + chunk] for start in range(0, len(tokens), chunk)]
        low = min((int(piece.min()) for piece in pieces), default=0)
        high = max((int(piece.max()) for piece in pieces), default=-1)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad, limit = (low, "negative") if low < 0 else (high, f"outside the tokenizer's {vocab_size} tokens")
            raise IndexedDataError(f"{prefix}.bin holds token id {bad}, {limit}: the file is corrupt or was made "
                                   f"with another tokenizer; {_rebuild_hint(prefix)}")
        return high

    def read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        sequence = int(np.searchsorted(self.starts, start, side="right")) - 1
        position = start
        while position < stop:
            offset = position - int(self.starts[sequence])
            length = min(stop, int(self.starts[sequence + 1])) - position
            if length > 0:
                pieces.append(self.dataset.get(sequence, offset=offset, length=length))
            position += max(length, 0)
            sequence += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
