"""Text documents -> Megatron ``.bin/.idx`` token files, tokenized by several worker processes in input order.

Workers each load the tokenizer from its file and encode chunks of documents; ``Pool.imap`` hands the results
back in input order, so the files are byte-identical for any number of workers. The pair is written under a
temporary name and renamed into place (``.bin`` first, then ``.idx``): a reader that finds the ``.idx`` finds a
complete pair, and processes racing to build the same cache write the same bytes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from xscale.data.indexed import write_indexed
from xscale.data.load_tokenizer import load_tokenizer

CHUNK_DOCUMENTS = 64
_worker_state: dict = {}


def _start_worker(tokenizer_path: str, append_eos: bool) -> None:
    tokenizer = load_tokenizer(tokenizer_path)
    _worker_state.update(tokenizer=tokenizer, eos=[tokenizer.eos_id] if append_eos else [])


def _encode(text: str) -> tuple[np.ndarray, int]:
    """(token ids of one document, its UTF-8 bytes for the progress bar), in a worker."""
    ids = _worker_state["tokenizer"].encode(text) + _worker_state["eos"]
    return np.asarray(ids, dtype=np.int64), len(text.encode("utf-8"))


def _encoded(documents: Iterable[str], tokenizer_path: str, append_eos: bool, workers: int
             ) -> Iterator[tuple[np.ndarray, int]]:
    if workers <= 1:
        _start_worker(tokenizer_path, append_eos)
        yield from map(_encode, documents)
        return
    # spawn: a forked child of a process holding torch's threads (or a process group) can deadlock.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_path, append_eos)) as pool:
        yield from pool.imap(_encode, documents, chunksize=CHUNK_DOCUMENTS)


def input_bytes(path: str | os.PathLike) -> int:
    """Bytes of a text file or of the .txt/.jsonl files of a folder (the progress bar's total)."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
    return path.stat().st_size if path.is_file() else 0


def tokenize_to_indexed(documents: Iterable[str], tokenizer_path: str | os.PathLike, output: str | os.PathLike, *,
                        workers: int = 1, append_eos: bool = True, progress_total: int | None = None
                        ) -> dict[str, int]:
    """Tokenize ``documents`` into ``output.bin``/``output.idx``; returns the counts of documents and tokens.
    With ``progress_total`` (input bytes) a progress bar runs on stderr."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    tokenizer_path = str(tokenizer_path)
    vocab_size = load_tokenizer(tokenizer_path).vocab_size
    output = str(output)
    temporary = f"{output}.tmp-{os.getpid()}"
    counts = {"documents": 0, "tokens": 0}
    # imported here: rich is the progress bar's alone, and this module is imported by every command that reads data
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[docs]} docs"),
                   TimeRemainingColumn(), console=Console(stderr=True), disable=progress_total is None)

    def counted() -> Iterator[np.ndarray]:
        task = bar.add_task("tokenize", total=progress_total, docs=0)
        for ids, size in _encoded(documents, tokenizer_path, append_eos, workers):
            counts["documents"] += 1
            counts["tokens"] += len(ids)
            bar.update(task, advance=size, docs=counts["documents"])
            yield ids
        bar.update(task, completed=progress_total)

    try:
        with bar:
            write_indexed(temporary, counted(), vocab_size)
        os.replace(temporary + ".bin", output + ".bin")
        os.replace(temporary + ".idx", output + ".idx")
    finally:
        for suffix in (".bin", ".idx"):
            Path(temporary + suffix).unlink(missing_ok=True)
    return counts
