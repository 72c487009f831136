"""Run a check on two gloo ranks spawned on this machine (the harness of the engine-level parallel tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xscale.launcher.env import free_port

WORLD = 2


def _run(rank: int, port: int, check, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        check(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(check, *args) -> None:
    """``check(rank, *args)`` on WORLD processes with a gloo process group initialised."""
    mp.spawn(_run, args=(free_port(), check, args), nprocs=WORLD, join=True)
