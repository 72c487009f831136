"""The spread of paired ratios: benches that alternate two workloads report the median of each round's ratio and its
interquartile range, which is the run's own noise (the machines here move by several percent from run to run);
and Spearman's rank correlation, how well one ranking (predicted) orders another (measured)."""

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


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks of ``values`` ascending, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(first: list[float], second: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the two lists' average ranks (ties share a rank); in [-1, 1]."""
    if len(first) != len(second) or len(first) < 2:
        raise ValueError(f"Spearman needs two lists of one length >= 2, got {len(first)} and {len(second)}")
    x, y = average_ranks(first), average_ranks(second)
    mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y))
    spread = (sum((a - mean_x) ** 2 for a in x) * sum((b - mean_y) ** 2 for b in y)) ** 0.5
    return covariance / spread if spread else 0.0
