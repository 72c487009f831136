"""Environment detection for every launcher, from fake environments (no cluster, no MPI needed)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from xscale.launcher.env import (
    LaunchError,
    World,
    _attempt_store,
    detect_world,
    expand_tasks_per_node,
    slurm_node_address,
    slurm_port,
)


class FakeComm:
    """An mpi4py-style COMM_WORLD seen from one rank; ``root_endpoint`` is what rank 0 would broadcast."""

    def __init__(self, rank: int, size: int, hosts: list[str], root_endpoint: tuple[str, int] = ("10.1.1.1", 4242)):
        self.rank, self.size, self.hosts, self.root_endpoint = rank, size, hosts, root_endpoint
        self.broadcasts: list[object] = []

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def allgather(self, value: object) -> list[str]:
        return list(self.hosts)

    def bcast(self, value: object, root: int = 0) -> object:
        self.broadcasts.append(value)
        return value if self.rank == root else self.root_endpoint


def no_scontrol(nodelist: str) -> list[str]:
    raise AssertionError(f"scontrol must not be called (nodelist {nodelist})")


def test_torchrun_variables():
    environ = {"TORCHELASTIC_RUN_ID": "r", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
               "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    world = detect_world(environ, hostnames_of=no_scontrol)
    assert world == World(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="10.0.0.7", master_port=29400, launcher="torchrun")
    assert world.num_nodes == 2


def test_plain_env_variables_take_precedence_over_slurm():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
               "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}
    world = detect_world(environ, hostnames_of=no_scontrol)
    assert (world.launcher, world.rank, world.world_size, world.local_world_size) == ("env", 1, 2, 2)


def slurm_step(**extra: str) -> dict[str, str]:
    environ = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
               "SLURM_JOB_NODELIST": "gpu[07-08]"}
    environ.update(extra)
    return environ


def test_slurm_step_uses_first_node_of_the_nodelist_at_its_node_address():
    calls = []

    def hostnames(nodelist: str) -> list[str]:
        calls.append(nodelist)
        return ["gpu07", "gpu08"]

    world = detect_world(slurm_step(), hostnames_of=hostnames, address_of={"gpu07": "10.3.0.7"}.__getitem__)
    assert calls == ["gpu[07-08]"]
    assert world == World(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="10.3.0.7", master_port=slurm_port(1234), launcher="slurm")


def test_slurm_node_address_reads_scontrol_and_falls_back_to_the_name(tmp_path, monkeypatch):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/bash\n[ "$3" = node1 ] || exit 1\n'
                        'echo "NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm_node_address("node1") == "127.0.0.1"
    assert slurm_node_address("unknown7") == "unknown7"


def test_slurm_step_prefers_exported_master_and_reads_uneven_task_counts():
    environ = slurm_step(MASTER_ADDR="10.2.0.1", MASTER_PORT="31000", SLURM_STEP_TASKS_PER_NODE="3,1",
                         SLURM_PROCID="3", SLURM_LOCALID="0")
    world = detect_world(environ, hostnames_of=no_scontrol)
    assert (world.master_addr, world.master_port, world.local_world_size) == ("10.2.0.1", 31000, 1)


def test_batch_shell_with_several_tasks_is_refused():
    environ = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(LaunchError, match="srun"):
        detect_world(environ, hostnames_of=no_scontrol)


def test_srun_with_mismatched_mpi_plugin_is_refused():
    environ = slurm_step(PMI_FD="11", PMI_RANK="0", PMI_SIZE="1")
    with pytest.raises(LaunchError, match="--mpi"):
        detect_world(environ, comm=FakeComm(0, 1, ["a"]), hostnames_of=lambda _: ["gpu07"])


def test_srun_with_matching_mpi_plugin():
    environ = slurm_step(PMI_FD="11", PMI_RANK="3", PMI_SIZE="4")
    world = detect_world(environ, comm=FakeComm(3, 4, ["a"] * 4), hostnames_of=lambda _: ["gpu07"])
    assert (world.launcher, world.rank, world.world_size) == ("slurm", 3, 4)


def test_mpi_bootstrap_inside_a_slurm_step_reads_mpi_comm_world():
    environ = slurm_step(XSCALE_BOOTSTRAP="mpi", PMIX_RANK="3")
    comm = FakeComm(3, 4, ["vm"] * 4, root_endpoint=("10.9.9.9", 5555))
    world = detect_world(environ, comm=comm, hostnames_of=no_scontrol)
    assert world == World(rank=3, local_rank=3, world_size=4, local_world_size=4, node_rank=0,
                          master_addr="10.9.9.9", master_port=5555, launcher="mpi")


def test_mpi_bootstrap_refuses_singletons_under_srun():
    """srun --mpi=pmix with an MPICH library: every task is an MPI world of one."""
    environ = slurm_step(XSCALE_BOOTSTRAP="mpi", SLURM_PROCID="0")
    with pytest.raises(LaunchError, match="started 4 ranks but MPI_COMM_WORLD has 1.*MPI4PY_LIBMPI"):
        detect_world(environ, comm=FakeComm(0, 1, ["vm"]), hostnames_of=no_scontrol)


def test_forced_bootstrap_wins_and_unknown_bootstrap_is_refused():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "XSCALE_BOOTSTRAP": "mpi"}
    world = detect_world(environ, comm=FakeComm(0, 3, ["a", "a", "b"]), hostnames_of=no_scontrol)
    assert (world.launcher, world.rank, world.world_size) == ("mpi", 0, 3)
    with pytest.raises(LaunchError, match="XSCALE_BOOTSTRAP='pmi' is not one of auto, torchrun, slurm, mpi"):
        detect_world({"XSCALE_BOOTSTRAP": "pmi"}, hostnames_of=no_scontrol)


def test_openmpi_rank_takes_the_broadcast_endpoint():
    environ = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    comm = FakeComm(3, 4, ["h1", "h1", "h2", "h2"], root_endpoint=("10.9.9.9", 5555))
    world = detect_world(environ, comm=comm, hostnames_of=no_scontrol)
    assert world == World(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          master_addr="10.9.9.9", master_port=5555, launcher="mpi")
    assert comm.broadcasts == [None]


def test_mpich_rank_zero_broadcasts_loopback_on_one_host():
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    comm = FakeComm(0, 2, ["h1", "h1"])
    world = detect_world(environ, comm=comm, hostnames_of=no_scontrol)
    (address, port), = comm.broadcasts
    assert (world.master_addr, world.master_port) == (address, port) == ("127.0.0.1", port)
    assert world.world_size == 2 and world.local_world_size == 2 and 0 < port < 65536


def test_mpi_launcher_and_library_disagree():
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="MPI_COMM_WORLD has 1"):
        detect_world(environ, comm=FakeComm(0, 1, ["h1"]), hostnames_of=no_scontrol)


def test_single_process():
    world = detect_world({}, hostnames_of=no_scontrol)
    assert (world.launcher, world.rank, world.world_size, world.master_addr) == ("single", 0, 1, "127.0.0.1")


@pytest.mark.parametrize("spec,expected", [("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1])])
def test_expand_tasks_per_node(spec, expected):
    assert expand_tasks_per_node(spec) == expected


def test_inconsistent_world_is_refused():
    with pytest.raises(LaunchError, match="outside a world of 2"):
        detect_world({"RANK": "2", "WORLD_SIZE": "2"}, hostnames_of=no_scontrol)
    with pytest.raises(LaunchError, match="not an integer"):
        detect_world({"RANK": "x", "WORLD_SIZE": "2"}, hostnames_of=no_scontrol)


INIT_AND_REDUCE = """
import torch, torch.distributed as dist
from xscale.launcher.env import init_distributed
world = init_distributed()
value = torch.tensor([float(world.rank + 1)])
dist.all_reduce(value)
print(f"RESULT {world.launcher} {dist.get_rank()} {dist.get_world_size()} {dist.get_backend()} {value.item()}")
dist.destroy_process_group()
"""


def test_init_distributed_from_a_slurm_step(tmp_path):
    """Two real processes that look like srun tasks start a gloo group through init_distributed."""
    from xscale.launcher.env import free_port

    port = str(free_port())
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "RANK", "WORLD_SIZE", "TORCHELASTIC", "OMPI_", "PMI"))}
    procs = []
    for rank in range(2):
        environ = dict(base, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                       SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", INIT_AND_REDUCE], env=environ, cwd=os.getcwd(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    results = sorted(line for out in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT slurm 0 2 gloo 3.0", "RESULT slurm 1 2 gloo 3.0"], outputs
    assert "xscale world: launcher=slurm world_size=2" in outputs[0]


def test_each_torchrun_attempt_meets_under_its_own_store_prefix(monkeypatch):
    """A restarted worker group must not read the failed attempt's keys (a dead peer's gloo address)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _attempt_store(None) is None  # not under torchrun: plain env://
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "RANK": "0", "WORLD_SIZE": "1",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    stores = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        stores.append(_attempt_store(datetime.timedelta(seconds=10)))
    stores[0].set("default_pg/rank_1", "the dead worker's address")
    assert not stores[1].check(["default_pg/rank_1"])
    stores[1].set("default_pg/rank_1", "the new worker's address")
    assert stores[0].get("default_pg/rank_1") == b"the dead worker's address"


def test_close_distributed_without_a_group_does_nothing():
    import torch.distributed as dist

    from xscale.launcher.env import close_distributed

    assert not dist.is_initialized()
    close_distributed()
    assert not dist.is_initialized()
