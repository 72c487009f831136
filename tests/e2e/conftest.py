"""The cluster tier: a real Slurm cluster (``bash .ci/cluster.sh up``) and MPI, driven the way a user drives them.

Every test here carries ``@pytest.mark.cluster`` and is skipped, with the reason in pytest's summary, unless
XSCALE_TEST_CLUSTER=1. Jobs run this worktree's xscale (PYTHONPATH), on CPU with gloo, with a tiny model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from cluster_tools import REPO, SLURM_CONF, TINY_CONFIG, Cluster, run

CLUSTER_VARIABLE = "XSCALE_TEST_CLUSTER"
SKIP_REASON = (f"cluster tier: needs a real Slurm cluster and MPI; run `bash .ci/cluster.sh up`, then "
               f"`{CLUSTER_VARIABLE}=1 pytest -m cluster tests/e2e`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(CLUSTER_VARIABLE) == "1":
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The running cluster; a cluster that the environment promises but that does not answer is a failure."""
    if not Path(SLURM_CONF).is_file():
        pytest.fail(f"{CLUSTER_VARIABLE}=1 but there is no Slurm configuration at {SLURM_CONF}: run "
                    "`bash .ci/cluster.sh up`, or set SLURM_CONF / XSCALE_CLUSTER_DIR")
    nodes = run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=60, cwd=REPO)
    idle = [line for line in nodes.splitlines() if line.split()[-1] in ("idle", "mixed", "allocated")]
    assert len(idle) >= 2, f"the cluster tier needs two usable nodes, sinfo says:\n{nodes}"
    return Cluster()


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny training in one process, no launcher: the reference every parallel launch is compared with."""
    workdir = tmp_path_factory.mktemp("single")
    run([sys.executable, "-m", "xscale", "train", str(TINY_CONFIG), f"train.output_dir={workdir / 'run'}"],
        timeout=300, cwd=workdir)
    return workdir / "run"
