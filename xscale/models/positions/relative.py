"""Clipped relative distances: which row of a table of learned distance embeddings holds each (query, key) pair.

Shared by the encodings that learn one vector per clipped distance: Shaw et al. 2018 (j - i clipped to [-k, k]),
DeBERTa (He et al. 2021, eq. 3: i - j clipped to [-k, k - 1]) and the Music Transformer (Huang et al. 2018).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from xscale.config.schema import ConfigError
from xscale.models.position import relative_distances


@dataclasses.dataclass
class ClippedDistanceOptions:
    """k, the farthest distance with a row of its own (farther pairs share the last rows); each encoding restates the
    field with its help line."""

    max_distance: int = 16
    least_distance: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.max_distance < self.least_distance:
            raise ConfigError(f"model.position.options.max_distance must be >= {self.least_distance}, "
                              f"got {self.max_distance}")


def distance_rows(distance: torch.Tensor, below: int, above: int) -> torch.Tensor:
    """clip(distance, -below, above) + below: the row of a table holding the distances -below, ..., above
    (below + above + 1 rows)."""
    return distance.clamp(-below, above) + below


def pair_rows(q_len: int, k_len: int, device: torch.device, below: int, above: int, *,
              query_minus_key: bool = False) -> torch.Tensor:
    """The table row (Tq, Tk) of each pair's distance j - i (``query_minus_key``: i - j), clipped to [-below, above];
    the queries are the last Tq of the Tk positions (a KV cache holds the others)."""
    distance = relative_distances(q_len, k_len, device)
    return distance_rows(-distance if query_minus_key else distance, below, above)
