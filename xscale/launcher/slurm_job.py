"""A Slurm job for a run: the request, its checks, the batch script and the sbatch call (``xscale submit``,
:mod:`xscale.commands.submit`, builds the request from a config and the command line).

Inside the job every node runs torchrun with c10d rendezvous on the head node (``--launcher torchrun``,
the default), or srun starts one task per rank (``--launcher srun``). The job asks for
``--signal=B:USR1@N --requeue --open-mode=append``: the batch shell traps USR1 and creates
``$XSCALE_STOP_FILE``; the trainer sees it through ``PreemptionHandler.should_stop()``, checkpoints and
requeues the job, which then resumes from ``latest``. A failure is retried too: torchrun restarts the workers
``--max-restarts`` times, then the batch shell requeues the job while ``SLURM_RESTART_COUNT`` is below
``--max-requeues``. Every user-supplied word is shell-quoted.
"""

from __future__ import annotations

import datetime
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xscale.config.schema import Config


class SubmitError(ValueError):
    """A job request that cannot run; the message says what to change."""


@dataclass
class JobRequest:
    """Everything the job script needs, after config and command line are merged."""

    config_path: Path
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    time: str
    partition: str | None = None
    account: str | None = None
    job_name: str = "xscale"
    launcher: str = "torchrun"  # torchrun | srun
    signal_seconds: int = 120
    max_restarts: int = 0  # torchrun restarts of failed workers (torchrun launcher only)
    max_requeues: int = 0  # requeues of a job whose step failed, counted by SLURM_RESTART_COUNT
    log_dir: Path = Path("runs/default/slurm")
    workdir: Path = Path(".")
    python: str = sys.executable
    module: str | None = None  # None: ``-m xscale train``
    cpus_per_task: int | None = None
    extra_sbatch: list[str] = field(default_factory=list)
    min_nodes: int | None = None  # elastic: Slurm may run (or requeue) the job on min_nodes..nodes nodes

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def program(self) -> list[str]:
        entry = ["-m", "xscale", "train"] if self.module is None else ["-m", self.module]
        return [*entry, str(self.config_path), *self.overrides]


# --------------------------------------------------------------------------- checks


TIME_PATTERN = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# Slurm writes <log dir>/<job name>-<id>.out (and xscale the script next to it): one plain file-name word only.
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def time_limit_seconds(text: str) -> int:
    """Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    match = TIME_PATTERN.match(text.strip())
    if not match:
        raise SubmitError(f"--time {text!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS)")
    days, first, second, third = match.groups()
    if days is not None:
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:
        hours, minutes, seconds = int(first), int(second), int(third)
    elif second is not None:
        hours, minutes, seconds = 0, int(first), int(second)
    else:
        hours, minutes, seconds = 0, int(first), 0
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise SubmitError(f"--time {text!r} must be positive")
    return total


def layout_degrees(config: Config) -> tuple[int, int | None]:
    """(product of the fixed mesh degrees, dp_shard or None when it absorbs the rest of the world)."""
    parallel = config.parallel
    fixed = parallel.tp * parallel.pp * parallel.cp * parallel.dp_replicate
    return fixed, None if parallel.dp_shard == -1 else parallel.dp_shard


def check_layout(config: Config, world_size: int) -> None:
    """The parallel layout must tile the job's ranks; the global batch must split over data parallel."""
    fixed, dp_shard = layout_degrees(config)
    parallel = config.parallel
    degrees = f"tp={parallel.tp} x pp={parallel.pp} x cp={parallel.cp} x dp_replicate={parallel.dp_replicate}"
    if dp_shard is None:
        if world_size % fixed:
            raise SubmitError(
                f"the job has {world_size} ranks, which {degrees} = {fixed} does not divide; "
                f"change --nodes / --gpus-per-node / --nproc-per-node to a multiple of {fixed}"
            )
        dp_shard = world_size // fixed
    elif fixed * dp_shard != world_size:
        raise SubmitError(
            f"the layout {degrees} x dp_shard={dp_shard} needs {fixed * dp_shard} ranks but the job has "
            f"{world_size}; set parallel.dp_shard=-1 or request {fixed * dp_shard} ranks"
        )
    data_parallel = parallel.dp_replicate * dp_shard
    if config.train.global_batch_size % data_parallel:
        raise SubmitError(
            f"train.global_batch_size={config.train.global_batch_size} does not split over the "
            f"{data_parallel} data-parallel ranks of this job; make it a multiple of {data_parallel}"
        )


def slurm_partitions() -> tuple[list[str], str | None] | None:
    """(partitions, default partition) from ``sinfo``; None when sinfo is not available here."""
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    names, default = [], None
    for line in result.stdout.split():
        name = line.rstrip("*")
        names.append(name)
        if line.endswith("*"):
            default = name
    return names, default


def check_partition(partition: str | None, partitions: tuple[list[str], str | None] | None) -> None:
    if partitions is None:
        return
    names, default = partitions
    if partition is None and default is None:
        raise SubmitError(
            f"this cluster has no default partition; pass --partition (one of {', '.join(names) or 'none found'})"
        )
    if partition is not None and partition not in names:
        raise SubmitError(f"partition {partition!r} does not exist here; available: {', '.join(names)}")


def check_request(request: JobRequest, config: Config) -> None:
    if not JOB_NAME.match(request.job_name):
        raise SubmitError(f"--job-name / launch.job_name {request.job_name!r} is not a plain name: use up to 128 "
                          "letters, digits, '.', '_' and '-' (a letter or digit first); the job's log and script "
                          "are written as <log dir>/<job name>-...")
    if request.nodes < 1:
        raise SubmitError(f"--nodes must be at least 1, got {request.nodes}")
    if request.gpus_per_node < 0:
        raise SubmitError(f"--gpus-per-node must be >= 0 (0 = CPU processes), got {request.gpus_per_node}")
    if request.nproc_per_node < 1:
        raise SubmitError(f"--nproc-per-node must be at least 1, got {request.nproc_per_node}")
    if request.gpus_per_node and request.nproc_per_node != request.gpus_per_node:
        raise SubmitError(
            f"--nproc-per-node={request.nproc_per_node} differs from --gpus-per-node={request.gpus_per_node}; "
            "xscale runs one process per GPU (leave --nproc-per-node out on GPU nodes)"
        )
    if request.cpus_per_task is not None and request.cpus_per_task < 1:
        raise SubmitError(f"--cpus-per-task must be at least 1, got {request.cpus_per_task}")
    if request.launcher not in ("torchrun", "srun"):
        raise SubmitError(f"--launcher must be torchrun or srun, got {request.launcher!r}")
    for flag, value in (("--max-restarts", request.max_restarts), ("--max-requeues", request.max_requeues)):
        if value < 0:
            raise SubmitError(f"{flag} must be >= 0, got {value}")
    if request.max_restarts and request.launcher != "torchrun":
        raise SubmitError("--max-restarts needs --launcher torchrun (srun does not restart ranks); use "
                          "--max-requeues to requeue the failed job instead")
    limit = time_limit_seconds(request.time)
    if request.signal_seconds < 0 or request.signal_seconds >= limit:
        raise SubmitError(
            f"--signal-seconds={request.signal_seconds} must lie in [0, time limit {limit} s): the USR1 warning "
            "has to arrive before Slurm ends the job"
        )
    if request.signal_seconds > 65535:
        raise SubmitError(f"--signal-seconds={request.signal_seconds} exceeds Slurm's maximum of 65535")
    for line in request.extra_sbatch:
        if "\n" in line:
            raise SubmitError(f"extra sbatch option {line!r} spans several lines")
    if request.min_nodes is not None and not 1 <= request.min_nodes <= request.nodes:
        raise SubmitError(f"--min-nodes={request.min_nodes} must lie in 1..{request.nodes} (--nodes)")
    if request.elastic and request.launcher != "torchrun":
        raise SubmitError("--min-nodes needs --launcher torchrun (one agent per node takes the ranks of the nodes "
                          "given); with srun every node count would need its own task layout")
    for nodes in range(request.min_nodes if request.elastic else request.nodes, request.nodes + 1):
        try:
            check_layout(config, nodes * request.nproc_per_node)
        except SubmitError as error:
            if nodes == request.nodes:
                raise
            raise SubmitError(f"on {nodes} node(s), which --min-nodes={request.min_nodes} allows: {error}") from None


# --------------------------------------------------------------------------- the job script


def _quote(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(word)) for word in words)


def _sbatch_option(option: str) -> str:
    """An #SBATCH line: sbatch reads these itself (no shell), so only newlines are forbidden."""
    return f"#SBATCH {option}"


HEAD_NODE_LINES = """\
# The head node hosts the rendezvous: its NodeAddr (node names need not resolve), as an IP address.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
HEAD_ADDR=${HEAD_ADDR:-$HEAD_NODE}
HEAD_IP=$(getent ahostsv4 "$HEAD_ADDR" | awk 'NR == 1 {print $1}')
export MASTER_ADDR=${HEAD_IP:-$HEAD_ADDR}
export MASTER_PORT=$((20000 + (SLURM_JOB_ID * 16 + ${SLURM_RESTART_COUNT:-0}) % 20000))
"""

# bash -c runs once per node: $0 is the python interpreter, "$@" the torchrun options and the program.
TORCHRUN_NODE_COMMAND = (
    "'exec \"$0\" -m xscale.launcher.torchrun "
    "--rdzv-conf=\"is_host=$([ \"$SLURM_NODEID\" = 0 ] && echo 1 || echo 0)\" \"$@\"'"
)

WAIT_LINES = """\
LAUNCH_PID=$!
# wait returns early when a trapped signal arrives; keep waiting until the ranks have exited.
while :; do
    wait "$LAUNCH_PID"
    STATUS=$?
    kill -0 "$LAUNCH_PID" 2>/dev/null || break
done
echo "xscale: job step exited with status $STATUS"
if [ -e "$XSCALE_REQUEUE_FILE" ]; then
    echo "xscale: the trainer saved a checkpoint and asked for a requeue: scontrol requeue $SLURM_JOB_ID"
    rm -f "$XSCALE_REQUEUE_FILE"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
RESTARTS=${SLURM_RESTART_COUNT:-0}
if [ "$STATUS" -ne 0 ] && [ "$RESTARTS" -lt "$XSCALE_MAX_REQUEUES" ]; then
    echo "xscale: the job step failed; requeue $((RESTARTS + 1)) of $XSCALE_MAX_REQUEUES: scontrol requeue $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
exit "$STATUS"
"""


def _requeue_lines(request: JobRequest) -> list[str]:
    """The stop and requeue files, the signal traps, and how many failures are requeued."""
    stop_file = shlex.quote(str(request.log_dir)) + '/".xscale-stop-$SLURM_JOB_ID"'
    requeue_file = shlex.quote(str(request.log_dir)) + '/".xscale-requeue-$SLURM_JOB_ID"'
    return [
        "# Preemption: Slurm sends USR1 to this shell (--signal=B:USR1@N) N seconds before the time limit.",
        "# The trainer polls the stop file (PreemptionHandler), checkpoints, leaves the requeue file and exits 0;",
        "# this shell then requeues the job, which resumes from the latest checkpoint.",
        f"export XSCALE_STOP_FILE={stop_file}",
        f"export XSCALE_REQUEUE_FILE={requeue_file}",
        'rm -f "$XSCALE_STOP_FILE" "$XSCALE_REQUEUE_FILE"',
        "# shellcheck disable=SC2317  # called by the traps below",
        "request_stop() {",
        '    echo "xscale: $1 received: the trainer checkpoints, requeues and exits"',
        '    touch "$XSCALE_STOP_FILE"',
        "}",
        "trap 'request_stop USR1' USR1",
        "trap 'request_stop TERM' TERM",
        "# Failures: a job step that exits non-zero is requeued (resuming from latest) while SLURM_RESTART_COUNT,",
        "# which counts every requeue (preemptions too), is below this.",
        f"XSCALE_MAX_REQUEUES={int(request.max_requeues)}",
    ]


def render_script(request: JobRequest) -> str:
    """The complete sbatch script for ``request`` (what --dry-run prints)."""
    log_dir = request.log_dir
    tasks_per_node = 1 if request.launcher == "torchrun" else request.nproc_per_node
    options = [f"--job-name={request.job_name}"]
    if request.elastic:
        # A node range alone starts on the fewest nodes when more are idle (Slurm 22.05, cons_tres): one task per
        # node, spread, takes every node there is, down to min_nodes when some are drained or down.
        options += [f"--nodes={request.min_nodes}-{request.nodes}", f"--ntasks={request.nodes}", "--spread-job"]
    else:
        options += [f"--nodes={request.nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if request.gpus_per_node:
        options.append(f"--gpus-per-node={request.gpus_per_node}")
    step_cpus = ""
    if request.cpus_per_task:
        options.append(f"--cpus-per-task={request.cpus_per_task}")
        step_cpus = f" --cpus-per-task={request.cpus_per_task}"
    if request.partition:
        options.append(f"--partition={request.partition}")
    if request.account:
        options.append(f"--account={request.account}")
    options += [
        f"--time={request.time}",
        f"--chdir={request.workdir}",
        f"--output={log_dir / '%x-%j.out'}",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{request.signal_seconds}",
        *request.extra_sbatch,
    ]
    for option in options:
        if "\n" in option:
            raise SubmitError(f"sbatch option {option!r} spans several lines")
    lines = [
        "#!/bin/bash",
        f"# Generated by `xscale submit` on {datetime.datetime.now().isoformat(timespec='seconds')}; "
        "resubmit with: sbatch THIS_FILE",
        *(_sbatch_option(option) for option in options),
        "",
        "set -uo pipefail",
        "echo \"xscale: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: "
        + (f"$SLURM_NNODES of {request.min_nodes}-{request.nodes} nodes x {request.nproc_per_node} processes "
           f"= world $((SLURM_NNODES * {request.nproc_per_node}))\"" if request.elastic else
           f"{request.nodes} nodes x {request.nproc_per_node} processes = world {request.world_size}\""),
        "",
        *_requeue_lines(request),
        "",
        HEAD_NODE_LINES,
    ]
    if request.launcher == "torchrun":
        step_tasks = ' --ntasks="$SLURM_NNODES"' if request.elastic else ""  # one agent per node it was given
        torchrun_options = [
            f"--nproc-per-node={request.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--max-restarts={int(request.max_restarts)}",
        ]
        lines += [
            "# One torchrun agent per node; node 0 hosts the c10d rendezvous store (is_host=1).",
            "# shellcheck disable=SC2016  # the single-quoted command expands on each node",
            f"srun --ntasks-per-node=1{step_tasks}{step_cpus} --kill-on-bad-exit=1 bash -c " + TORCHRUN_NODE_COMMAND
            + " \\",
            # elastic: the nodes this start of the job was given (a requeue may get fewer or more)
            f"    {shlex.quote(request.python)} "
            + ('--nnodes="$SLURM_NNODES" ' if request.elastic else f"--nnodes={request.nodes} ")
            + f"{_quote(torchrun_options)} \\",
            '    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="xscale-$SLURM_JOB_ID" \\',
            f"    {_quote(request.program)} &",
        ]
    else:
        lines += [
            "# One task per rank; xscale.launcher.env reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID.",
            f"srun --ntasks-per-node={request.nproc_per_node}{step_cpus} --kill-on-bad-exit=1 \\",
            f"    {shlex.quote(request.python)} {_quote(request.program)} &",
        ]
    lines.append(WAIT_LINES)
    return "\n".join(lines)


def submit(script: str, request: JobRequest, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """Write the script next to the logs, sbatch it, return the job id."""
    request.log_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    script_path = request.log_dir / f"{request.job_name}-{stamp}.sbatch"
    script_path.write_text(script)
    try:
        result = run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True)
    except FileNotFoundError as error:
        raise SubmitError("sbatch is not on PATH: run xscale submit on a Slurm login node (or use --dry-run)") from error
    if result.returncode != 0:
        raise SubmitError(f"sbatch refused the job ({script_path}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]
