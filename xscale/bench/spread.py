"""The spread of paired ratios: benches that alternate two workloads report the median of each round's ratio and its
interquartile range, which is the run's own noise (the machines here move by several percent from run to run)."""

from __future__ import annotations

import statistics


def median_and_quartiles(values: list[float]) -> tuple[float, float, float] | None:
    """(median, first quartile, third quartile) of ``values``; None for none."""
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), low, high
