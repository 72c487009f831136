"""Launching xscale: environment detection (torchrun, Slurm, MPI), Slurm submission, preemption."""

from xscale.launcher.env import LaunchError, World, detect_world, init_distributed
from xscale.launcher.preemption import PreemptionHandler

__all__ = ["LaunchError", "PreemptionHandler", "World", "detect_world", "init_distributed"]
