"""Flat all-gather and reduce-scatter: their results on 2 gloo ranks, with no deprecation warning from torch."""

from __future__ import annotations

import warnings

import torch
from spawned import WORLD, spawn

from xscale.parallel.collectives import all_gather_flat, reduce_scatter_flat


def check(rank: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered = torch.empty(2 * WORLD)
        all_gather_flat(gathered, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
        assert gathered.tolist() == [0.0, 1.0, 10.0, 11.0]
        mine = torch.empty(2)
        reduce_scatter_flat(mine, torch.arange(2.0 * WORLD) * (rank + 1))
        assert mine.tolist() == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]  # rows summed over ranks: x (1 + 2)


def test_flat_collectives_on_two_ranks():
    spawn(check)
