"""Pathfinder (Linsley et al. 2018; LRA's image task, Tay et al. 2021, sec. 3.5): a grey image of dashed curves
and two dots; label 1 when the dots sit at the two ends of one curve, 0 when they end different curves. The model
reads the flattened pixels as tokens, so it must follow a curve across the whole sequence.

Curves are random walks with smoothly drifting heading, drawn dashed (``dash`` pixels on, ``gap`` off);
distractor curves cross the image too. Pixel tokens: background, curve, dot (LRA's 256 grey levels become three,
which keeps the vocabulary of a CPU-sized run small).
"""

from __future__ import annotations

import math
import random

from xscale.data.fixed_vocab import FixedVocab

BACKGROUND, CURVE, DOT = 0, 1, 2
Point = tuple[int, int]


def draw_curve(rng: random.Random, size: int, length: int, dash: int, gap: int) -> tuple[list[Point], list[Point]]:
    """(drawn pixels, [start, end]) of one dashed curve inside a ``size`` x ``size`` image; the ends are drawn."""
    row, col = rng.uniform(1, size - 2), rng.uniform(1, size - 2)
    heading, turn = rng.uniform(0, 2 * math.pi), 0.0
    path = []
    for _ in range(length):
        path.append((int(round(row)), int(round(col))))
        turn = max(-0.5, min(0.5, turn + rng.gauss(0, 0.15)))
        heading += turn
        next_row, next_col = row + math.sin(heading), col + math.cos(heading)
        if not (0 <= next_row <= size - 1 and 0 <= next_col <= size - 1):  # reflect off the border
            heading += math.pi
            next_row, next_col = row + math.sin(heading), col + math.cos(heading)
        row, col = min(max(next_row, 0), size - 1), min(max(next_col, 0), size - 1)
    drawn = [point for index, point in enumerate(path) if index % (dash + gap) < dash]
    return drawn + [path[-1]], [path[0], path[-1]]


class PathfinderTask:
    """``size`` x ``size`` images flattened row by row (``size`` = floor(sqrt(seq_len))); classes 0 (dots on
    different curves) and 1 (dots on the two ends of one curve), balanced."""

    num_classes = 2

    def __init__(self, seq_len: int, curves: int = 3, curve_length: int | None = None, dash: int = 2,
                 gap: int = 1) -> None:
        self.size = math.isqrt(seq_len)
        if self.size < 4 or curves < 2:
            raise ValueError(f"pathfinder: seq_len={seq_len} must hold a 4x4 image and curves={curves} be >= 2")
        self.vocab = FixedVocab(["bg", "curve", "dot"])
        self.curves, self.dash, self.gap = curves, dash, gap
        self.curve_length = curve_length or 2 * self.size

    def image(self, rng: random.Random) -> tuple[list[list[int]], int, list[list[Point]]]:
        """(pixels, label, each curve's [start, end])."""
        pixels = [[BACKGROUND] * self.size for _ in range(self.size)]
        ends = []
        for _ in range(self.curves):
            drawn, curve_ends = draw_curve(rng, self.size, self.curve_length, self.dash, self.gap)
            for row, col in drawn:
                pixels[row][col] = CURVE
            ends.append(curve_ends)
        connected = rng.random() < 0.5
        dots = ends[0] if connected else [ends[0][0], ends[1][1]]
        for row, col in dots:
            pixels[row][col] = DOT
        return pixels, int(connected), ends

    def example(self, rng: random.Random) -> tuple[list[int], int]:
        pixels, label, _ = self.image(rng)
        return [self.vocab.first_symbol_id + value for row in pixels for value in row], label
