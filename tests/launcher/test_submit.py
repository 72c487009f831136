"""``xscale submit``: the rendered job script (quoting, layout arithmetic, rendezvous, preemption) and refusals."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from xscale.commands import submit
from xscale.launcher.slurm_job import SubmitError, time_limit_seconds

TINY = "model:\n  d_model: 32\n  n_layers: 2\n  n_heads: 2\n  vocab_size: 64\ntrain:\n  global_batch_size: 32\n"


@pytest.fixture
def awkward_config(tmp_path: Path) -> Path:
    """A config whose path has spaces, a quote and a command substitution that must never run."""
    folder = tmp_path / "my runs $(touch PWNED) it's"
    folder.mkdir()
    path = folder / "tiny config.yaml"
    path.write_text(TINY)
    return path


def no_sbatch(*args, **kwargs):
    pytest.fail("sbatch must not run for a refused or dry-run request")


def dry_run(capsys, monkeypatch, tmp_path, *argv: str) -> str:
    monkeypatch.chdir(tmp_path)
    assert submit.main([*argv, "--dry-run"], partitions=lambda: pytest.fail("no sinfo on dry-run"),
                       run=no_sbatch) == 0
    return capsys.readouterr().out


def write_tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_job_script(script: str, tmp_path: Path, node_id: str = "0", requeue: bool = False, status: int = 0,
                   restart_count: str | None = None, expect: int = 0) -> tuple[list[str], str]:
    """Execute the job script with fake srun/scontrol/getent/python (which exits ``status``); return the python argv
    and the calls log."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    argv_file = tmp_path / "argv"
    # srun drops its own options and runs the command, like one task on node SLURM_NODEID.
    write_tool(tools, "srun", f'echo "srun $*" >> {log}\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    write_tool(tools, "scontrol", f"""echo "scontrol $*" >> {log}
case "$1 $2" in
  "show hostnames") printf 'gpu07\\ngpu08\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.3.0.7 NodeHostName=$3 Version=22.05" ;;
esac
""")
    write_tool(tools, "getent", "exit 2\n")
    requeue_line = 'touch "$XSCALE_REQUEUE_FILE"\n' if requeue else ""
    write_tool(tools, "fake-python", f'printf "%s\\0" "$@" > {argv_file}\n{requeue_line}exit {status}\n')
    script = script.replace(f"    {submit.DEFAULT_PYTHON} ", f"    {tools / 'fake-python'} ")
    environ = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", SLURM_JOB_ID="321",
                   SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NODEID=node_id)
    environ.pop("SLURM_RESTART_COUNT", None)
    if restart_count is not None:
        environ["SLURM_RESTART_COUNT"] = restart_count
    (tmp_path / "runs/default/slurm").mkdir(parents=True, exist_ok=True)  # sbatch needs the log folder
    result = subprocess.run(["bash", "-c", script], env=environ, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == expect, result.stdout + result.stderr
    return argv_file.read_text().split("\0")[:-1], log.read_text()


def test_path_with_spaces_and_command_substitution_stays_one_argument(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "train.steps=30", "train.lr=0.5",
                     "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "2", "--time", "30")
    argv, calls = run_job_script(script, tmp_path)
    port = 20000 + 321 * 16 % 20000
    assert argv == ["-m", "xscale.launcher.torchrun", "--rdzv-conf=is_host=1", "--nnodes=2", "--nproc-per-node=2",
                    "--rdzv-backend=c10d", "--max-restarts=0", f"--rdzv-endpoint=10.3.0.7:{port}",
                    "--rdzv-id=xscale-321", "-m", "xscale", "train", str(awkward_config), "train.steps=30",
                    "train.lr=0.5"]
    assert not list(tmp_path.rglob("PWNED")), "a $(...) in the config path was executed"
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1" in calls
    assert "scontrol requeue" not in calls


def test_rendezvous_host_only_on_node_zero(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--nproc-per-node", "2")
    argv, _ = run_job_script(script, tmp_path, node_id="1")
    assert "--rdzv-conf=is_host=0" in argv


def test_requeue_file_makes_the_script_requeue_after_the_step(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--nproc-per-node", "2")
    _, calls = run_job_script(script, tmp_path, requeue=True)
    assert calls.splitlines()[-1] == "scontrol requeue 321"


def test_gpu_layout_arithmetic_and_preemption_lines(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "parallel.tp=8", "parallel.pp=2",
                     "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--account", "proj x",
                     "--time", "2-00:00:00", "--signal-seconds", "300")
    lines = script.splitlines()
    for expected in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj x", "#SBATCH --time=2-00:00:00",
                     "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@300",
                     "trap 'request_stop USR1' USR1"):
        assert expected in lines, expected
    assert "4 nodes x 8 processes = world 32" in script
    assert "--nnodes=4 --nproc-per-node=8" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in script


def test_srun_launcher_starts_one_task_per_rank(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--gpus-per-node", "4",
                     "--launcher", "srun", "--cpus-per-task", "6")
    assert "#SBATCH --ntasks-per-node=4" in script.splitlines()
    assert "#SBATCH --cpus-per-task=6" in script.splitlines()
    argv, calls = run_job_script(script, tmp_path)
    assert argv == ["-m", "xscale", "train", str(awkward_config)]
    assert "srun --ntasks-per-node=4 --cpus-per-task=6 --kill-on-bad-exit=1" in calls


def test_layout_defaults_come_from_the_config(capsys, monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(TINY + "launch:\n  nodes: 3\n  nproc_per_node: 2\n  time: '00:20:00'\n"
                      "  requeue_signal_seconds: 90\n  extra_sbatch: ['--exclusive']\n")
    script = dry_run(capsys, monkeypatch, tmp_path, str(config), "train.global_batch_size=6")
    for expected in ("#SBATCH --nodes=3", "#SBATCH --time=00:20:00", "#SBATCH --signal=B:USR1@90",
                     "#SBATCH --exclusive"):
        assert expected in script.splitlines()
    assert "world 6" in script


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "0"], "--nodes must be at least 1"),
    (["--nodes", "1", "--gpus-per-node", "4", "parallel.tp=8"], "does not divide"),
    (["--nodes", "2", "--gpus-per-node", "4", "parallel.dp_shard=2"], "needs 2 ranks but the job has 8"),
    (["--nodes", "1", "--gpus-per-node", "4", "--nproc-per-node", "2"], "one process per GPU"),
    (["--nodes", "1", "--nproc-per-node", "3"], "global_batch_size=32 does not split over the 3"),
    (["--time", "00:01:00", "--signal-seconds", "120"], "before Slurm ends the job"),
    (["--time", "soon"], "not a Slurm time"),
    (["--gpus-per-node", "-1"], "--gpus-per-node must be >= 0"),
    (["model.n_heads=3"], "n_heads"),
    (["--launcher", "srun", "--max-restarts", "1"], "--max-restarts needs --launcher torchrun"),
    (["--max-requeues", "-1"], "--max-requeues must be >= 0"),
    (["launch.max_restarts=-2"], "launch.max_restarts must be >= 0"),
    (["--nodes", "2", "--min-nodes", "3"], "--min-nodes=3 must lie in 1..2"),
    (["--nodes", "2", "--min-nodes", "1", "--launcher", "srun"], "--min-nodes needs --launcher torchrun"),
    (["--nodes", "3", "--min-nodes", "2", "--nproc-per-node", "2", "train.global_batch_size=6"],
     "on 2 node(s), which --min-nodes=2 allows: train.global_batch_size=6 does not split over the 4"),
])
def test_bad_requests_fail_before_sbatch(capsys, monkeypatch, tmp_path, argv, message):
    config = tmp_path / "c.yaml"
    config.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    assert submit.main([str(config), *argv], partitions=lambda: (["cpu"], "cpu"), run=no_sbatch) == 2
    assert message in capsys.readouterr().err


def test_missing_or_unknown_partition(capsys, monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    no_default = lambda: (["gpu", "debug"], None)  # noqa: E731
    assert submit.main([str(config)], partitions=no_default, run=no_sbatch) == 2
    assert "no default partition; pass --partition (one of gpu, debug)" in capsys.readouterr().err
    assert submit.main([str(config), "--partition", "gpus"], partitions=no_default, run=no_sbatch) == 2
    assert "partition 'gpus' does not exist here" in capsys.readouterr().err


def test_submission_prints_job_id_and_log(capsys, monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    commands = []

    def fake_sbatch(command, **kwargs):
        commands.append(command)
        assert Path(command[-1]).read_text().startswith("#!/bin/bash")
        return subprocess.CompletedProcess(command, 0, "4711;cluster\n", "")

    assert submit.main([str(config), "--nodes", "2", "--nproc-per-node", "2", "--partition", "cpu"],
                       partitions=lambda: (["cpu"], None), run=fake_sbatch) == 0
    out = capsys.readouterr().out
    log_dir = (tmp_path / "runs/default/slurm").resolve()
    assert commands[0][:2] == ["sbatch", "--parsable"] and Path(commands[0][2]).parent == log_dir
    assert "Submitted batch job 4711" in out and f"logs: {log_dir}/xscale-4711.out" in out


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("10:30", 630), ("01:00:00", 3600), ("1-2", 93600),
                                          ("1-02:03", 93780), ("1-00:00:05", 86405)])
def test_time_limit_formats(text, seconds):
    assert time_limit_seconds(text) == seconds


def test_time_limit_rejects_zero():
    with pytest.raises(SubmitError):
        time_limit_seconds("0")


def test_max_restarts_reach_torchrun_and_max_requeues_the_batch_shell(capsys, monkeypatch, tmp_path, awkward_config):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--nproc-per-node", "2",
                     "--max-restarts", "2", "--max-requeues", "3")
    assert "XSCALE_MAX_REQUEUES=3" in script.splitlines()
    argv, calls = run_job_script(script, tmp_path)
    assert "--max-restarts=2" in argv and "--max-restarts=0" not in argv
    assert "scontrol requeue" not in calls  # the step succeeded


@pytest.mark.parametrize("restart_count,requeued", [(None, True), ("2", True), ("3", False)])
def test_a_failed_step_is_requeued_while_the_restart_count_is_below_max_requeues(
        capsys, monkeypatch, tmp_path, awkward_config, restart_count, requeued):
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--nproc-per-node", "2",
                     "--max-requeues", "3")
    _, calls = run_job_script(script, tmp_path, status=1, restart_count=restart_count, expect=0 if requeued else 1)
    assert ("scontrol requeue 321" in calls) == requeued


def test_restarts_and_requeues_default_to_the_launch_section(capsys, monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(TINY + "launch:\n  max_restarts: 4\n  max_requeues: 1\n")
    script = dry_run(capsys, monkeypatch, tmp_path, str(config), "--nodes", "2", "--nproc-per-node", "2")
    assert "--max-restarts=4" in script and "XSCALE_MAX_REQUEUES=1" in script.splitlines()


def test_min_nodes_lets_slurm_run_the_job_on_fewer_nodes(capsys, monkeypatch, tmp_path, awkward_config):
    """Elastic: the allocation may have 1 or 2 nodes; torchrun takes the count this start of the job was given."""
    script = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--min-nodes", "1",
                     "--nproc-per-node", "2")
    assert "#SBATCH --nodes=1-2\n#SBATCH --ntasks=2\n#SBATCH --spread-job\n" in script
    assert '--nnodes="$SLURM_NNODES"' in script
    assert "world $((SLURM_NNODES * 2))" in script
    fixed = dry_run(capsys, monkeypatch, tmp_path, str(awkward_config), "--nodes", "2", "--nproc-per-node", "2")
    assert "#SBATCH --nodes=2\n" in fixed and "--nnodes=2 " in fixed


@pytest.mark.parametrize("launcher", ["torchrun", "srun", "elastic"])
def test_the_generated_script_is_shellcheck_clean(capsys, monkeypatch, tmp_path, launcher):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    config = tmp_path / "c.yaml"  # a plain path: shellcheck rightly notes a quoted '$(' in the awkward one
    config.write_text(TINY)
    elastic = ["--min-nodes", "1"] if launcher == "elastic" else []
    script = dry_run(capsys, monkeypatch, tmp_path, str(config), "--nodes", "2", "--nproc-per-node", "2",
                     "--launcher", "torchrun" if launcher == "elastic" else launcher, "--max-requeues", "2", *elastic)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_job_script_names_no_interpreter_of_this_machine(capsys, monkeypatch, tmp_path):
    """The issue's case: --dry-run printed this machine's venv python into the job script."""
    (tmp_path / "c.yaml").write_text(TINY)
    script = dry_run(capsys, monkeypatch, tmp_path, "c.yaml")
    assert submit.sys.executable not in script and f"    {submit.DEFAULT_PYTHON} " in script
    pinned = dry_run(capsys, monkeypatch, tmp_path, "c.yaml", "--python", "/opt/env/bin/python")
    assert "    /opt/env/bin/python " in pinned
