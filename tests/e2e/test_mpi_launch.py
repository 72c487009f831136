"""The same tiny training under torchrun -n 2, mpiexec -n 2 (MPICH) and srun --mpi=pmix -n 2 (Open MPI, two
Slurm nodes): every launcher reaches world size 2 and prints the same losses; srun without an MPI plugin is
refused.

The MPI runs go through launch/mpirun.sh, which makes every rank read its world from MPI_COMM_WORLD and
take rank 0's rendezvous address by an mpi4py broadcast (XSCALE_BOOTSTRAP=mpi).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
from cluster_tools import REPO, TINY_CONFIG, losses_by_step, run

pytestmark = pytest.mark.cluster

STEPS = 20
LAUNCH_TIMEOUT = 240
OPEN_MPI_LIBRARY = "libmpi.so.40"  # Debian's Open MPI, installed by .ci/cluster.sh (its libpmix serves srun)
LOSS_RTOL = 1e-5  # against the single process: the same global batch, reduced in another order (fp32)


def mpich_mpiexec() -> str:
    """The mpiexec of the MPICH that mpi4py loads by default: the one the mpich wheel put next to python."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    assert found, "no mpiexec: pip install mpich (the dev extras) or apt-get install mpich"
    return found


def train(tmp_path: Path, name: str, launcher: list[str], **environ: str) -> tuple[str, dict[int, float]]:
    """Run the tiny config under ``launcher`` (a launch/ script and its options); (output, losses by step)."""
    output_dir = tmp_path / name
    output = run([*launcher, str(TINY_CONFIG), f"train.output_dir={output_dir}"], timeout=LAUNCH_TIMEOUT,
                 cwd=tmp_path, **environ)
    return output, losses_by_step(output_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def torchrun_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    output, losses = train(tmp_path_factory.mktemp("torchrun"), "run",
                           [str(REPO / "launch/torchrun.sh"), "--nproc-per-node", "2", "--python", sys.executable])
    assert "xscale world: launcher=torchrun world_size=2" in output, output
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def assert_same_losses(losses: dict[int, float], expected: dict[int, float], rel_tol: float = 0.0) -> None:
    assert sorted(losses) == sorted(expected)
    for step in expected:
        assert math.isclose(losses[step], expected[step], rel_tol=rel_tol, abs_tol=0.0), (
            step, losses[step], expected[step])


def test_torchrun_matches_the_single_process(cluster, torchrun_losses, single_process_run):
    assert_same_losses(torchrun_losses, losses_by_step(single_process_run / "metrics.jsonl"), LOSS_RTOL)


def test_mpiexec_matches_torchrun(cluster, torchrun_losses, tmp_path):
    output, losses = train(tmp_path, "mpiexec", [str(REPO / "launch/mpirun.sh"), "-n", "2",
                                                 "--python", sys.executable], MPIRUN=mpich_mpiexec())
    assert "xscale world: launcher=mpi world_size=2" in output, output
    assert_same_losses(losses, torchrun_losses)


def test_srun_pmix_on_two_nodes_matches_torchrun(cluster, torchrun_losses, tmp_path):
    output, losses = train(tmp_path, "srun", [str(REPO / "launch/mpirun.sh"), "--srun", "-n", "2",
                                              "--ntasks-per-node", "1", "--libmpi", OPEN_MPI_LIBRARY,
                                              "--launcher-arg=--time=10", "--python", sys.executable])
    # --ntasks-per-node 1 puts the two ranks on the two Slurm nodes (srun fails if it cannot).
    assert "xscale world: launcher=mpi world_size=2" in output, output
    assert_same_losses(losses, torchrun_losses)


def test_srun_without_an_mpi_plugin_is_refused(cluster, tmp_path):
    """srun --mpi=none makes every task an MPI world of one: every rank must refuse, none may train alone."""
    output = run([str(REPO / "launch/mpirun.sh"), "--srun", "--mpi", "none", "-n", "2", "--ntasks-per-node", "1",
                  "--launcher-arg=--time=5", "--python", sys.executable, str(TINY_CONFIG),
                  f"train.output_dir={tmp_path / 'refused'}"], timeout=LAUNCH_TIMEOUT, cwd=tmp_path, check=False)
    assert "the launcher started 2 ranks but MPI_COMM_WORLD has 1" in output, output
    assert "--mpi=pmix" in output
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
