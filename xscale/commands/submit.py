"""``xscale submit``: render a Slurm batch script from a config, check it, and submit it with sbatch
(:mod:`xscale.launcher.slurm_job` holds the job, its script and its checks)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.commands.parser import CommandParser
from xscale.config.load import load_config
from xscale.config.schema import Config, ConfigError
from xscale.launcher.slurm_job import (
    JobRequest,
    SubmitError,
    check_partition,
    check_request,
    render_script,
    slurm_partitions,
    submit,
)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="xscale submit",
        description="Render a Slurm job for CONFIG (+ overrides) and submit it with sbatch.",
    )
    parser.add_argument("config", help="YAML config of the run")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=1000")
    parser.add_argument("--nodes", type=int, help="nodes (default: launch.nodes)")
    parser.add_argument("--min-nodes", type=int,
                        help="elastic: Slurm may start or requeue the job on as few as N nodes (sbatch --nodes=N-MAX); "
                             "the run keeps train.global_batch_size by gradient accumulation (launch.min_nodes)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node; 0 runs CPU processes (launch.gpus_per_node)")
    parser.add_argument("--nproc-per-node", type=int, help="processes per node on CPU nodes (launch.nproc_per_node)")
    parser.add_argument("--cpus-per-task", type=int,
                        help="CPUs per Slurm task (torchrun: per node agent and all its workers; srun: per rank)")
    parser.add_argument("--partition", help="Slurm partition (launch.partition)")
    parser.add_argument("--account", help="Slurm account (launch.account)")
    parser.add_argument("--time", help="time limit, e.g. 04:00:00 (launch.time)")
    parser.add_argument("--job-name", help="job name (launch.job_name)")
    parser.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                        help="torchrun per node (default) or srun one task per rank")
    parser.add_argument("--signal-seconds", type=int,
                        help="seconds before the time limit that USR1 asks for save-and-requeue "
                             "(launch.requeue_signal_seconds)")
    parser.add_argument("--max-restarts", type=int,
                        help="torchrun restarts failed workers up to N times; they resume from the latest "
                             "checkpoint (launch.max_restarts)")
    parser.add_argument("--max-requeues", type=int,
                        help="requeue the job after a failed step while SLURM_RESTART_COUNT < N (launch.max_requeues)")
    parser.add_argument("--log-dir", help="where Slurm writes the job output (default: <train.output_dir>/slurm)")
    parser.add_argument("--sbatch-arg", action="append", default=[],
                        help="extra sbatch option, repeatable, e.g. --sbatch-arg=--exclusive")
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help=f"python interpreter on the compute nodes (default {DEFAULT_PYTHON}, found on the PATH "
                             "sbatch exports from this shell, so an activated venv's; a path pins one)")
    parser.add_argument("--module", help="run `python -m MODULE CONFIG overrides` instead of `xscale train`")
    parser.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    return parser


# Not sys.executable: a job script names no path of the machine it was rendered on (a login node's venv).
DEFAULT_PYTHON = "python3"


def _pick(value: object, default: object) -> object:
    return default if value is None else value


def request_from_args(args: argparse.Namespace, config: Config, workdir: Path) -> JobRequest:
    launch = config.launch
    gpus = int(_pick(args.gpus_per_node, launch.gpus_per_node))
    nproc = args.nproc_per_node
    if nproc is None:
        nproc = gpus if gpus > 0 else launch.nproc_per_node
    log_dir = Path(args.log_dir) if args.log_dir else Path(config.train.output_dir) / "slurm"
    return JobRequest(
        config_path=(workdir / args.config).resolve(),
        overrides=list(args.overrides),
        nodes=int(_pick(args.nodes, launch.nodes)),
        min_nodes=int(_pick(args.min_nodes, launch.min_nodes)) or None,
        gpus_per_node=gpus,
        nproc_per_node=int(nproc),
        time=str(_pick(args.time, launch.time)),
        partition=_pick(args.partition, launch.partition),
        account=_pick(args.account, launch.account),
        job_name=str(_pick(args.job_name, launch.job_name)),
        launcher=args.launcher,
        signal_seconds=int(_pick(args.signal_seconds, launch.requeue_signal_seconds)),
        max_restarts=int(_pick(args.max_restarts, launch.max_restarts)),
        max_requeues=int(_pick(args.max_requeues, launch.max_requeues)),
        log_dir=(workdir / log_dir).resolve(),
        workdir=workdir.resolve(),
        python=args.python,
        module=args.module,
        cpus_per_task=args.cpus_per_task,
        extra_sbatch=[*launch.extra_sbatch, *args.sbatch_arg],
    )


def main(
    argv: Sequence[str] | None = None,
    *,
    partitions: Callable[[], tuple[list[str], str | None] | None] = slurm_partitions,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        request = request_from_args(args, config, Path.cwd())
        check_request(request, config)
        if not args.dry_run:
            check_partition(request.partition, partitions())
        script = render_script(request)
        if args.dry_run:
            print(script)
            return 0
        job_id = submit(script, request, run)
    except (ConfigError, SubmitError) as error:
        print(f"xscale submit: error: {error}", file=sys.stderr)
        return 2
    log = request.log_dir / f"{request.job_name}-{job_id}.out"
    print(f"Submitted batch job {job_id}: {request.nodes} nodes x {request.nproc_per_node} processes "
          f"(world {request.world_size})")
    print(f"logs: {log}")
    print(f"watch: squeue -j {job_id}; tail -f {shlex.quote(str(log))}; cancel: scancel {job_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
