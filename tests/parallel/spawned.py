"""Run a check on two gloo ranks spawned on this machine (the harness of the engine-level parallel tests).

The ranks meet through a file store in a fresh temporary folder, not a TCP port picked beforehand: a port found
free can be taken by another test process before rank 0 binds it (a concurrent test run then joins the wrong
rendezvous, and its gloo ranks abort). Every rank passes a barrier before tearing its process group down, so none
closes its connections while a peer is still finishing a collective with it.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from xscale.launcher.local import start_local

WORLD = 2


def _run(rank: int, store: str, world: int, check, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        check(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(check, *args, world: int = WORLD) -> None:
    """``check(rank, *args)`` on ``world`` processes with a gloo process group initialised."""
    with tempfile.TemporaryDirectory(prefix="xscale-spawned-") as scratch:
        start_local(_run, world, (os.path.join(scratch, "store"), world, check, args))
