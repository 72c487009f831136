"""Elastic resume: the same global batch on another number of data-parallel ranks, by gradient accumulation.

A checkpoint records its data-parallel degree and the per-rank microbatch it ran (``meta.json``: ``data_parallel``,
``micro_batch_size``). Resumed on a different number of data-parallel ranks with ``train.micro_batch_size`` unset,
each rank keeps that microbatch where it divides the rank's new share (so a rank's activation memory stays what it
was when half the ranks are gone) and runs share / microbatch of them per step: the optimizer sees the same
``train.global_batch_size`` samples per step, and since the sampler's position is counted in global samples
(:mod:`xscale.data.sampler`) every sample is still read exactly once. Growing back shrinks the share again.
"""

from __future__ import annotations

from typing import Any


def largest_divisor_at_most(number: int, limit: int) -> int:
    """The largest divisor of ``number`` that is at most ``limit`` (at least 1)."""
    return max(divisor for divisor in range(1, max(1, min(number, limit)) + 1) if number % divisor == 0)


def elastic_micro_batch(meta: dict[str, Any], global_batch_size: int, dp_size: int,
                        configured: int | None, batch_statistics: str | None = None) -> tuple[int, str] | None:
    """The per-rank microbatch a resume from a checkpoint with ``meta`` runs on ``dp_size`` data-parallel ranks,
    and the one line that says so; None when nothing changes (the same degree, a ``configured``
    ``train.micro_batch_size``, or a checkpoint that predates these fields). ``batch_statistics``: what in the model
    reads a microbatch as a whole (:func:`xscale.models.batch_statistics.statistics_over_the_microbatch`); then the
    rank's whole share stays one microbatch, as one process would run it, and the line says memory grows."""
    saved_dp, saved_micro = meta.get("data_parallel"), meta.get("micro_batch_size")
    if configured is not None or not saved_dp or not saved_micro or int(saved_dp) == dp_size:
        return None
    share = global_batch_size // dp_size
    if batch_statistics is not None:
        if share <= int(saved_micro):
            return None
        return share, (f"xscale: elastic resume: {dp_size} data-parallel rank(s), the checkpoint ran {saved_dp}; "
                       f"global batch {global_batch_size} kept as one microbatch of {share} per rank, not "
                       f"accumulated: the model's {batch_statistics} span a microbatch (each rank's activation "
                       f"memory grows {share / int(saved_micro):g}x; train.micro_batch_size splits it anyway)")
    micro = largest_divisor_at_most(share, int(saved_micro))
    microbatches = share // micro
    change = "elastic resume" if dp_size < int(saved_dp) else "elastic resume, grown back"
    return micro, (f"xscale: {change}: {dp_size} data-parallel rank(s), the checkpoint ran {saved_dp}; global batch "
                   f"{global_batch_size} kept, each rank runs {microbatches} microbatch(es) of {micro} per step"
                   + (" (gradient accumulation)" if microbatches > 1 else ""))
