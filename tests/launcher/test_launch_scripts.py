"""launch/: torchrun.sh, mpirun.sh and slurm.sbatch, run with fake cluster tools (the real cluster: tests/e2e)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = sorted(LAUNCH.iterdir())
AWKWARD = "my runs/it's $(touch PWNED).yaml"


def write_tool(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def clean_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, with tmp_path/tools first on PATH."""
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("SLURM_", "MASTER_", "NNODES", "NPROC_PER_NODE", "NODE_RANK", "RDZV_ID",
                                      "MPIRUN", "PYTHON", "MAX_RESTARTS", "XSCALE_MAX_REQUEUES"))}
    environ["PATH"] = f"{tmp_path / 'tools'}:{environ['PATH']}"
    environ.update(extra)
    return environ


def run_script(name: str, *argv: str, tmp_path: Path, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(LAUNCH / name), *argv], env=clean_environ(tmp_path, **extra), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def printed(name: str, *argv: str, tmp_path: Path, **extra: str) -> list[str]:
    """The command the script would run, as an argument list (the script prints it shell-quoted)."""
    return shlex.split(run_script(name, "--print", *argv, tmp_path=tmp_path, **extra).stdout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_scripts_parse_and_have_a_usage_header(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    header = script.read_text().splitlines()[:12]
    assert all(line.startswith("#") for line in header) and any("Usage" in line for line in header), header


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_shellcheck_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_torchrun_one_node_keeps_every_argument_whole(tmp_path):
    argv = printed("torchrun.sh", "--nproc-per-node", "2", AWKWARD, "train.steps=30", tmp_path=tmp_path)
    assert argv == ["python3", "-m", "xscale.launcher.torchrun", "--nproc-per-node=2", "--max-restarts=0", "--standalone",
                    "-m", "xscale", "train", AWKWARD, "train.steps=30"]
    assert not list(tmp_path.rglob("PWNED"))


def test_torchrun_warm_forks_the_workers_from_a_preloaded_server(tmp_path):
    argv = printed("torchrun.sh", "--warm", "--nproc-per-node", "2", "c.yaml", tmp_path=tmp_path)
    assert argv[:4] == ["python3", "-m", "xscale.launcher.torchrun", "--warm=torch,xscale.commands.train"]
    assert printed("torchrun.sh", "c.yaml", tmp_path=tmp_path, WARM="1")[3] == "--warm=torch,xscale.commands.train"


def test_torchrun_several_nodes_rendezvous_on_node_zero(tmp_path):
    common = ["--nnodes", "2", "--nproc-per-node", "4", "--master", "10.0.0.1:29400", "--module",
              "xscale.launcher.smoke", "c.yaml"]
    node0 = printed("torchrun.sh", "--node-rank", "0", *common, tmp_path=tmp_path)
    node1 = printed("torchrun.sh", *common, tmp_path=tmp_path, NODE_RANK="1", PYTHON="/opt/py/bin/python")
    assert node0 == ["python3", "-m", "xscale.launcher.torchrun", "--nproc-per-node=4", "--max-restarts=0", "--nnodes=2",
                     "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=xscale",
                     "--rdzv-conf=is_host=1", "-m", "xscale.launcher.smoke", "c.yaml"]
    assert node1[0] == "/opt/py/bin/python" and "--rdzv-conf=is_host=0" in node1


def test_torchrun_inside_slurm_reads_the_job(tmp_path):
    tools = tmp_path / "tools"
    write_tool(tools, "scontrol", """case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.3.0.7 NodeHostName=vm" ;;
esac
""")
    write_tool(tools, "getent", "exit 2\n")
    argv = printed("torchrun.sh", "c.yaml", tmp_path=tmp_path, SLURM_JOB_ID="321", SLURM_NNODES="2",
                   SLURM_NODEID="1", SLURM_JOB_NODELIST="node[1-2]", SLURM_GPUS_ON_NODE="8",
                   SLURM_RESTART_COUNT="1")
    port = 20000 + (321 * 16 + 1) % 20000
    assert argv[3:10] == ["--nproc-per-node=8", "--max-restarts=0", "--nnodes=2", "--rdzv-backend=c10d",
                          f"--rdzv-endpoint=10.3.0.7:{port}", "--rdzv-id=xscale-321", "--rdzv-conf=is_host=0"]


@pytest.mark.parametrize("argv,environ", [(["--max-restarts", "3"], {}), ([], {"MAX_RESTARTS": "3"})])
def test_torchrun_max_restarts_reaches_torchrun(tmp_path, argv, environ):
    for nodes in (["--nproc-per-node", "2"], ["--nnodes", "2", "--master", "h:1"]):
        command = printed("torchrun.sh", *nodes, *argv, "c.yaml", tmp_path=tmp_path, **environ)
        assert command.count("--max-restarts=3") == 1 and "--max-restarts=0" not in command


@pytest.mark.parametrize("argv,environ", [(["--min-nodes", "1"], {}), ([], {"MIN_NODES": "1"})])
def test_torchrun_min_nodes_makes_the_rendezvous_elastic(tmp_path, argv, environ):
    command = printed("torchrun.sh", "--nnodes", "2", "--master", "h:1", "--max-restarts", "2", *argv, "c.yaml",
                      tmp_path=tmp_path, **environ)
    assert "--nnodes=1:2" in command and "--rdzv-backend=c10d" in command
    fixed = printed("torchrun.sh", "--nnodes", "2", "--master", "h:1", "--min-nodes", "2", "c.yaml", tmp_path=tmp_path)
    assert "--nnodes=2" in fixed


@pytest.mark.parametrize("argv,message", [
    ([], "CONFIG is required"),
    (["--nnodes", "2", "--min-nodes", "3", "--master", "h", "c.yaml"], "--min-nodes 3 must lie in 1..2"),
    (["--nnodes", "2", "--min-nodes", "1", "--master", "h", "c.yaml"], "needs --max-restarts > 0"),
    (["--nnodes", "2", "c.yaml"], "2 nodes need node 0's address"),
    (["--nnodes", "2", "--node-rank", "2", "--master", "h", "c.yaml"], "--node-rank 2 is outside 2 nodes"),
    (["--nproc-per-node", "two", "c.yaml"], "take integers, got 'two'"),
    (["--max-restarts", "-1", "c.yaml"], "take integers, got '-1'"),
    (["--frobnicate", "c.yaml"], "unknown option --frobnicate"),
])
def test_torchrun_refusals(tmp_path, argv, message):
    result = run_script("torchrun.sh", *argv, tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and message in result.stderr


def test_mpirun_forces_the_mpi_bootstrap(tmp_path):
    write_tool(tmp_path / "tools", "mpirun", 'echo "HYDRA build details:"\n')
    argv = printed("mpirun.sh", "-n", "2", "--launcher-arg=--bind-to=none", AWKWARD, "x=1", tmp_path=tmp_path)
    assert argv == ["mpirun", "-n", "2", "--bind-to=none", "env", "XSCALE_BOOTSTRAP=mpi", "python3", "-m",
                    "xscale", "train", AWKWARD, "x=1"]


def test_mpirun_open_mpi_as_root_is_allowed_to_run(tmp_path):
    tool = write_tool(tmp_path / "tools", "ompi-run", 'echo "mpirun (Open MPI) 4.1.4"\n')
    argv = printed("mpirun.sh", "-n", "4", "--hostfile", "hosts", "c.yaml", tmp_path=tmp_path, MPIRUN=str(tool))
    expected_root = ["--allow-run-as-root"] if os.getuid() == 0 else []
    assert argv[:3 + len(expected_root) + 2] == [str(tool), "-n", "4", *expected_root, "--hostfile", "hosts"]


def test_mpirun_under_srun(tmp_path):
    argv = printed("mpirun.sh", "--srun", "-n", "4", "--ntasks-per-node", "2", "--libmpi", "libmpi.so.40",
                   "--module", "xscale.launcher.smoke", "c.yaml", tmp_path=tmp_path)
    assert argv == ["srun", "--mpi=pmix", "--ntasks=4", "--kill-on-bad-exit=1", "--ntasks-per-node=2", "env",
                    "XSCALE_BOOTSTRAP=mpi", "MPI4PY_LIBMPI=libmpi.so.40", "python3", "-m", "xscale.launcher.smoke",
                    "c.yaml"]


@pytest.mark.parametrize("argv,message", [
    (["c.yaml"], "-n N (the number of ranks, at least 1) is required"),
    (["-n", "0", "c.yaml"], "is required, got '0'"),
    (["--srun", "-n", "2", "--hostfile", "h", "c.yaml"], "--hostfile is for mpirun"),
    (["-n", "2", "--ntasks-per-node", "1", "c.yaml"], "--ntasks-per-node is for --srun"),
])
def test_mpirun_refusals(tmp_path, argv, message):
    result = run_script("mpirun.sh", *argv, tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and message in result.stderr


def sbatch_environ(tmp_path: Path, python_body: str) -> dict[str, str]:
    """Fake srun (runs the command once, as node 0), scontrol and python; the launch dir is the real one."""
    tools = tmp_path / "tools"
    log = tmp_path / "calls.log"
    write_tool(tools, "srun", f'echo "srun $*" >> {log}\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    write_tool(tools, "scontrol", f'echo "scontrol $*" >> {log}\n')
    write_tool(tools, "fake-python", f'printf "%s\\0" "$@" > {tmp_path / "argv"}\n{python_body}')
    return clean_environ(tmp_path, SLURM_JOB_ID="55", SLURM_NODEID="0", SLURM_NNODES="1",
                         SLURM_JOB_NODELIST="node1", SLURM_SUBMIT_DIR=str(tmp_path), XSCALE_LAUNCH_DIR=str(LAUNCH),
                         NPROC_PER_NODE="2", PYTHON=str(tools / "fake-python"))


def test_sbatch_template_runs_torchrun_on_each_node(tmp_path):
    environ = sbatch_environ(tmp_path, "")
    result = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), AWKWARD, "train.steps=3"], env=environ,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == ["-m", "xscale.launcher.torchrun", "--nproc-per-node=2", "--max-restarts=0", "--standalone", "-m",
                    "xscale", "train", AWKWARD, "train.steps=3"]
    calls = (tmp_path / "calls.log").read_text()
    assert calls.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash")
    assert "scontrol requeue" not in calls


def test_sbatch_template_usr1_stops_the_trainer_and_requeues(tmp_path):
    """USR1 to the batch shell creates the stop file; the 'trainer' sees it, leaves the requeue file, exits 0."""
    body = ('while [ ! -e "$XSCALE_STOP_FILE" ]; do sleep 0.1; done\n'
            'touch "$XSCALE_REQUEUE_FILE"\n')
    environ = sbatch_environ(tmp_path, body)
    shell = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), "c.yaml"], env=environ, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "argv").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    shell.send_signal(signal.SIGUSR1)
    output, _ = shell.communicate(timeout=60)
    assert shell.returncode == 0, output
    assert "USR1 received" in output
    assert (tmp_path / "calls.log").read_text().splitlines()[-1] == "scontrol requeue 55"
    assert not list(tmp_path.glob(".xscale-*")), "stop/requeue files must not survive into the requeued job"


@pytest.mark.parametrize("restart_count,requeued", [(None, True), ("1", True), ("2", False)])
def test_sbatch_template_requeues_a_failed_step_up_to_max_requeues(tmp_path, restart_count, requeued):
    """The step fails (torchrun exits 1 after its own --max-restarts): requeued while SLURM_RESTART_COUNT < 2."""
    environ = sbatch_environ(tmp_path, "exit 1\n")
    environ["XSCALE_MAX_REQUEUES"] = "2"
    if restart_count is not None:
        environ["SLURM_RESTART_COUNT"] = restart_count
    result = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--max-restarts", "1", "c.yaml"], env=environ,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert "--max-restarts=1" in argv
    calls = (tmp_path / "calls.log").read_text()
    assert ("scontrol requeue 55" in calls) == requeued, result.stdout
    assert result.returncode == (0 if requeued else 1), result.stdout + result.stderr


def test_sbatch_template_never_requeues_a_successful_step(tmp_path):
    environ = sbatch_environ(tmp_path, "exit 0\n")
    environ["XSCALE_MAX_REQUEUES"] = "5"
    result = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "c.yaml"], env=environ, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "scontrol requeue" not in (tmp_path / "calls.log").read_text()
