"""``xscale bench collectives``: the flat all-gather and reduce-scatter over gloo, torch's collectives against the
direct transfers xscale uses on gloo (:mod:`xscale.parallel.collectives`), in one run.

Each of ``--world`` local processes (one thread each) times, alternating rounds: gloo's all-gather and
reduce-scatter, the same through xscale's broadcasts and sends, and gloo's all-reduce of the whole buffer (what DDP
sends) for scale. Figures: median milliseconds per call over the rounds, on rank 0, and torch / xscale.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from xscale.commands.parity import run_local
from xscale.commands.parser import CommandParser
from xscale.parallel.collectives import (
    direct_all_gather,
    direct_reduce_scatter,
    torch_all_gather,
    torch_reduce_scatter,
)


def _timed(call) -> float:
    dist.barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _measure(megabytes: float, rounds: int) -> dict[str, float]:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = max(world, int(megabytes * 2**20 / 4) // world * world)
    full, chunk = torch.randn(elements), torch.empty(elements // world)
    gathered = torch.empty(elements)

    calls = {
        "all_gather torch": lambda: torch_all_gather(gathered, chunk),
        "all_gather xscale": lambda: direct_all_gather(gathered, chunk),
        "reduce_scatter torch": lambda: torch_reduce_scatter(chunk, full),
        "reduce_scatter xscale": lambda: direct_reduce_scatter(chunk, full),
        "all_reduce (whole buffer)": lambda: dist.all_reduce(full),
    }
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(rounds + 1):  # the first round warms up
        for name, call in calls.items():
            elapsed = _timed(call)
            if index:
                seconds[name].append(elapsed)
    return {name: statistics.median(values) for name, values in seconds.items()} if rank == 0 else {}


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo processes")
    parser.add_argument("--megabytes", type=float, default=25.0, help="the whole buffer (gathered / scattered)")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    figures = run_local(_measure, args.world, args.megabytes, args.rounds)[0]
    print(f"gloo collectives: {args.world} local processes, {args.megabytes:g} MB buffer, fp32, median of "
          f"{args.rounds} alternating rounds (rank 0)")
    for name, seconds in figures.items():
        print(f"  {name:<28} {seconds * 1e3:8.2f} ms")
    for kind in ("all_gather", "reduce_scatter"):
        print(f"{kind}: torch / xscale time {figures[f'{kind} torch'] / figures[f'{kind} xscale']:.2f}x")
    return 0
