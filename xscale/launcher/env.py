"""Who am I in the job? One place that reads torchrun, Slurm, MPI or a single process and starts torch.distributed.

Precedence: torchrun/elastic variables (also plain env:// RANK + WORLD_SIZE) > a Slurm job step
(SLURM_PROCID inside ``srun``) > an MPI launcher (OpenMPI / MPICH-Hydra / PMIx variables, or mpi4py) >
a single process. ``XSCALE_BOOTSTRAP=torchrun|slurm|mpi`` picks one reader instead (``launch/mpirun.sh``
sets ``mpi``: ranks from MPI_COMM_WORLD, rank 0's address broadcast with mpi4py, also inside ``srun``).
A launcher that promises several ranks while the process sees a world of one (srun's ``--mpi`` plugin not
matching the MPI library, a batch script that forgot ``srun``) is refused: those ranks would otherwise
train alone and silently.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class LaunchError(RuntimeError):
    """The launch environment is inconsistent; the message says what to change."""


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | env | slurm | mpi | single

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise LaunchError(f"{self.launcher}: rank {self.rank} is outside a world of {self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"{self.launcher}: local rank {self.local_rank} is outside {self.local_world_size} local ranks"
            )
        if not 0 < self.master_port < 65536:
            raise LaunchError(f"{self.launcher}: master port {self.master_port} is not a valid TCP port")

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def describe(self) -> str:
        return (
            f"xscale world: launcher={self.launcher} world_size={self.world_size} nodes={self.num_nodes} "
            f"local_world_size={self.local_world_size} master={self.master_addr}:{self.master_port}"
        )


BOOTSTRAP_VARIABLE = "XSCALE_BOOTSTRAP"
BOOTSTRAPS = ("auto", "torchrun", "slurm", "mpi")
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LIBRARY_HINT = ("With several MPI libraries installed, MPI4PY_LIBMPI names the one mpi4py loads "
                "(libmpi.so.40: Open MPI, libmpi.so.12: MPICH).")
MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMI_FD", "PMIX_RANK")


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"environment variable {name} is required by this launcher but is not set")
        return default
    try:
        return int(raw)
    except ValueError as error:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from error


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise LaunchError(f"cannot read Slurm tasks-per-node '{spec}'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``node[1-2]``) with ``scontrol show hostnames``."""
    try:
        result = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({error}); "
            "set MASTER_ADDR to the head node's address"
        ) from error
    return result.stdout.split()


def slurm_node_address(node: str) -> str:
    """The address slurmd of ``node`` is reached at (its NodeAddr), which need not be the node's name."""
    try:
        result = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return node
    match = re.search(r"\bNodeAddr=(\S+)", result.stdout) if result.returncode == 0 else None
    return match.group(1) if match else node


def slurm_port(job_id: int) -> int:
    """A per-job port in [20000, 40000) so that jobs sharing a head node do not collide."""
    return 20000 + job_id % 20000


# --------------------------------------------------------------------------- one reader per launcher


def _from_torchrun(environ: Mapping[str, str]) -> World:
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" not in environ else None)
    return World(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", 0),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 29500),
        launcher=launcher,
    )


def _from_slurm(
    environ: Mapping[str, str], hostnames_of: Callable[[str], list[str]], address_of: Callable[[str], str]
) -> World:
    world_size = _int(environ, "SLURM_NTASKS", _int(environ, "SLURM_NPROCS", 1))
    node_rank = _int(environ, "SLURM_NODEID", 0)
    tasks_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    local_world_size = _int(environ, "SLURM_NTASKS_PER_NODE", 1)
    if tasks_spec:
        counts = expand_tasks_per_node(tasks_spec)
        local_world_size = counts[node_rank] if node_rank < len(counts) else counts[-1]
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError("Slurm step without SLURM_JOB_NODELIST; set MASTER_ADDR to the head node's address")
        master_addr = address_of(hostnames_of(nodelist)[0])
    master_port = _int(environ, "MASTER_PORT", slurm_port(_int(environ, "SLURM_JOB_ID", 0)))
    return World(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher="slurm",
    )


def _mpi_comm() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise LaunchError(
            "launched by MPI but mpi4py is not installed: pip install mpi4py (the xscale[mpi] extra), "
            "or set MASTER_ADDR and MASTER_PORT for every rank"
        ) from error
    return MPI.COMM_WORLD


def _launched_size(environ: Mapping[str, str]) -> int | None:
    """How many ranks the launcher says it started: its MPI variables, or srun's task count."""
    for name in MPI_SIZE_VARIABLES:
        if environ.get(name):
            return _int(environ, name)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return _int(environ, "SLURM_NTASKS", 1)
    return None


def _from_mpi(environ: Mapping[str, str], comm: Any) -> World:
    rank, world_size = comm.Get_rank(), comm.Get_size()
    launched = _launched_size(environ)
    if launched is not None and launched != world_size:
        raise LaunchError(
            f"the launcher started {launched} ranks but MPI_COMM_WORLD has {world_size}: the MPI library that "
            "mpi4py loaded does not talk to the launcher. Under srun pass --mpi=pmix (Open MPI) or --mpi=pmi2 "
            f"(MPICH); otherwise start the ranks with that library's own mpiexec. {LIBRARY_HINT}"
        )
    hostnames = comm.allgather(socket.gethostname())
    nodes = list(dict.fromkeys(hostnames))
    same_host = [r for r, host in enumerate(hostnames) if host == hostnames[rank]]
    if rank == 0:
        if environ.get("MASTER_ADDR"):
            master_addr = environ["MASTER_ADDR"]
        elif len(nodes) == 1:
            master_addr = "127.0.0.1"
        else:
            master_addr = socket.gethostbyname(socket.getfqdn())
        master_port = _int(environ, "MASTER_PORT", 0) or free_port()
        endpoint = (master_addr, master_port)
    else:
        endpoint = None
    master_addr, master_port = comm.bcast(endpoint, root=0)
    return World(
        rank=rank,
        local_rank=same_host.index(rank),
        world_size=world_size,
        local_world_size=len(same_host),
        node_rank=nodes.index(hostnames[rank]),
        master_addr=master_addr,
        master_port=master_port,
        launcher="mpi",
    )


def _check_slurm_mpi(world: World, environ: Mapping[str, str], comm: Any | None) -> None:
    """Under ``srun --mpi=...`` the MPI library must see the tasks srun started."""
    if not any(name in environ for name in MPI_MARKERS):
        return
    if comm is None:
        try:
            from mpi4py import MPI
        except ImportError:
            return  # an MPI environment without mpi4py: Slurm's own variables define the world
        comm = MPI.COMM_WORLD
    if comm.Get_size() != world.world_size:
        raise LaunchError(
            f"srun started {world.world_size} tasks but MPI sees a world of {comm.Get_size()}: srun's --mpi "
            f"plugin does not match the MPI library (Open MPI: srun --mpi=pmix, MPICH: srun --mpi=pmi2). {LIBRARY_HINT}"
        )


def detect_world(
    environ: Mapping[str, str] | None = None,
    *,
    comm: Any | None = None,
    hostnames_of: Callable[[str], list[str]] = slurm_hostnames,
    address_of: Callable[[str], str] = slurm_node_address,
) -> World:
    """Read this process's rank, world and rendezvous address from the launcher's environment.

    ``comm`` (an mpi4py-style communicator), ``hostnames_of`` and ``address_of`` exist so tests can fake MPI
    and scontrol.
    """
    environ = os.environ if environ is None else environ
    bootstrap = environ.get(BOOTSTRAP_VARIABLE) or "auto"
    if bootstrap not in BOOTSTRAPS:
        raise LaunchError(f"{BOOTSTRAP_VARIABLE}={bootstrap!r} is not one of {', '.join(BOOTSTRAPS)}")
    in_slurm_step = "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ
    if bootstrap == "torchrun" or (
        bootstrap == "auto" and ("TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ))
    ):
        return _from_torchrun(environ)
    if bootstrap == "slurm" or (bootstrap == "auto" and in_slurm_step):
        world = _from_slurm(environ, hostnames_of, address_of)
        _check_slurm_mpi(world, environ, comm)
        return world
    if bootstrap == "mpi" or comm is not None or any(name in environ for name in MPI_MARKERS):
        return _from_mpi(environ, comm if comm is not None else _mpi_comm())
    slurm_tasks = _int(environ, "SLURM_NTASKS", 1) if "SLURM_JOB_ID" in environ else 1
    if slurm_tasks > 1:
        raise LaunchError(
            f"this Slurm job has SLURM_NTASKS={slurm_tasks} but this process runs outside any job step, as a "
            "world of 1; start the ranks with srun (one task per rank) or run torchrun on each node"
        )
    return World(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 0) or free_port(),
        launcher="single",
    )


# --------------------------------------------------------------------------- starting torch.distributed


def export_world(world: World, environ: Any = None) -> None:
    """Write the env:// variables torch.distributed (and libraries under it) read."""
    environ = os.environ if environ is None else environ
    environ.update(
        RANK=str(world.rank), WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(world.local_rank),
        LOCAL_WORLD_SIZE=str(world.local_world_size), GROUP_RANK=str(world.node_rank),
        MASTER_ADDR=world.master_addr, MASTER_PORT=str(world.master_port),
    )


def local_device(world: World) -> Any:
    """This rank's device: the accelerator of the machine (CUDA, XPU, ...) at index local_rank, else the CPU."""
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    return torch.device(accelerator.type, world.local_rank % count)


def resolve_backend(backend: str, device: Any) -> str:
    """``auto``: the default backend of the device (gloo on CPU, nccl on CUDA)."""
    import torch.distributed as dist

    if backend != "auto":
        if backend not in ("gloo", "nccl", "mpi", "xccl", "ucc"):
            raise LaunchError(f"backend={backend!r} is not one of auto, gloo, nccl, mpi, xccl, ucc")
        return backend
    return dist.get_default_backend_for_device(device)


def init_distributed(
    backend: str = "auto",
    *,
    timeout: datetime.timedelta | None = None,
    verbose: bool = True,
) -> World:
    """Detect the world, export RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK and init the process group.

    Idempotent: with a process group already initialised it only returns the world.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        # Read back what was exported at the start: no launcher collective (MPI) runs a second time.
        exported = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        return _from_torchrun(os.environ) if exported else detect_world()
    world = detect_world()
    export_world(world)
    device = local_device(world)
    backend = resolve_backend(backend, device)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    store = _attempt_store(timeout)
    dist.init_process_group(
        backend=backend, init_method=None if store else "env://", store=store, rank=world.rank,
        world_size=world.world_size, timeout=timeout,
        device_id=device if device.type != "cpu" and backend != "gloo" else None,
    )
    if verbose and world.rank == 0:
        print(f"{world.describe()} backend={backend} device={device.type}", flush=True)
    return world


def close_distributed(*, meet_first: bool = True) -> None:
    """Destroy the process group (nothing without one), after a barrier unless ``meet_first`` is false (a run that
    failed: its peers may never arrive). Left to exit-time destructors, gloo's threads can abort a rank after a
    successful run ("terminate called without an active exception"); the barrier keeps a rank from closing its
    connections while a peer still talks to it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if meet_first:
        dist.barrier()
    dist.destroy_process_group()


def _attempt_store(timeout: datetime.timedelta | None) -> Any:
    """Under torchrun, the env:// store with a prefix per restart attempt (None elsewhere).

    A restarted worker group meets in the agent's store again, where the failed attempt's keys remain (gloo's
    listening addresses, NCCL's unique id, the watchdog's heartbeats): without the prefix a fast rank of the new
    attempt reads a dead peer's address and the restart fails ("connectFullMesh failed ... Connection refused")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    store, _, _ = next(dist.rendezvous("env://", timeout=timeout or default_pg_timeout))
    return dist.PrefixStore(f"xscale/attempt_{attempt}", store)
