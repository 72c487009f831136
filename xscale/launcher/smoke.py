"""Launcher smoke test: init_distributed, an all_reduce check, and a tiny data-parallel run that survives preemption.

``python -m xscale.launcher.smoke [CONFIG] [overrides] [--step-seconds S]`` under any launcher (torchrun,
srun, mpiexec, xscale submit --module xscale.launcher.smoke). It trains a linear regression y = X w with SGD,
gradients averaged over the ranks (so the result does not depend on the world size beyond rounding), checks
``PreemptionHandler.should_stop()`` after every step, and on a stop saves, requeues and exits 0; a restart
resumes from ``<output_dir>/smoke/latest``. Rank 0 prints one line per step and a final ``smoke: done`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from xscale.config.load import load_config
from xscale.launcher.env import close_distributed, init_distributed
from xscale.launcher.preemption import PreemptionHandler

FEATURES = 8


def batch_for_step(step: int, seed: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank and for every world size."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    inputs = torch.randn(global_batch, FEATURES, generator=generator, dtype=torch.float64)
    true_weights = torch.linspace(-1.0, 1.0, FEATURES, dtype=torch.float64)
    targets = inputs @ true_weights + 0.01 * torch.randn(global_batch, generator=generator, dtype=torch.float64)
    return inputs, targets


def parameter_digest(weights: torch.Tensor) -> str:
    return hashlib.sha256(weights.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def save(directory: Path, step: int, weights: torch.Tensor, momentum: torch.Tensor) -> None:
    """Rank 0 writes step-N.pt, then flips ``latest`` atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "weights": weights, "momentum": momentum}, directory / f"step-{step}.pt")
    marker = directory / "latest.tmp"
    marker.write_text(f"step-{step}.pt\n")
    os.replace(marker, directory / "latest")


def load_latest(directory: Path) -> dict | None:
    marker = directory / "latest"
    if not marker.exists():
        return None
    return torch.load(directory / marker.read_text().strip(), weights_only=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xscale.launcher.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="xscale YAML config (train.steps, seed, lr, output_dir, batch)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20")
    parser.add_argument("--step-seconds", type=float, default=float(os.environ.get("XSCALE_SMOKE_STEP_SECONDS", 0)),
                        help="sleep per step, to preempt mid-run (default: $XSCALE_SMOKE_STEP_SECONDS or 0)")
    args = parser.parse_intermixed_args(argv)
    config = load_config(args.config, args.overrides)
    train = config.train

    world = init_distributed(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    if probe.item() != size * (size + 1) / 2:
        raise RuntimeError(f"all_reduce gave {probe.item()}, expected {size * (size + 1) / 2}")
    if train.global_batch_size % size:
        raise ValueError(f"train.global_batch_size={train.global_batch_size} must be a multiple of the world {size}")

    directory = Path(config.checkpoint.dir or Path(train.output_dir) / "smoke")
    weights = torch.zeros(FEATURES, dtype=torch.float64)
    momentum = torch.zeros(FEATURES, dtype=torch.float64)
    start = 0
    state = load_latest(directory)
    if state is not None:
        start, weights, momentum = state["step"], state["weights"], state["momentum"]
    if rank == 0:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(f"smoke: rank 0 of {size} ({world.launcher}), start step {start}, slurm restart {restart}", flush=True)

    handler = PreemptionHandler().install()
    loss = torch.zeros(())
    for step in range(start, train.steps):
        inputs, targets = batch_for_step(step, train.seed, train.global_batch_size)
        local_inputs, local_targets = inputs[rank::size], targets[rank::size]
        residual = local_inputs @ weights - local_targets
        gradient = 2.0 * local_inputs.T @ residual / len(local_targets)
        loss = (residual**2).mean()
        dist.all_reduce(gradient)
        dist.all_reduce(loss)
        gradient /= size
        loss /= size
        momentum = 0.9 * momentum + gradient
        weights = weights - train.lr * momentum
        if rank == 0:
            print(f"smoke: step {step + 1} loss {loss.item():.10f}", flush=True)
        time.sleep(args.step_seconds)
        if step + 1 < train.steps and handler.should_stop():
            if rank == 0:
                save(directory, step + 1, weights, momentum)
                print(f"smoke: preempted after step {step + 1}; checkpoint {directory}/latest", flush=True)
            handler.requeue()
            dist.destroy_process_group()
            return 0
    if rank == 0:
        save(directory, train.steps, weights, momentum)
        print(f"smoke: done world {size} steps {train.steps} loss {loss.item():.10f} "
              f"params {parameter_digest(weights)}", flush=True)
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
