"""torch's intra-op thread count set for a block of work and restored after it (on the calling thread)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (``torch.set_num_threads``), then restore the count."""
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
