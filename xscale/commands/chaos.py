"""``xscale chaos [CONFIG] [overrides] --faults N``: a training job under torchrun with faults injected at seeded
random steps; per fault the detection time, restart time, steps recomputed and seconds lost, the run's goodput, and
whether its final state equals a fault-free run's bit for bit."""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.commands.parser import CommandParser
from xscale.launcher.chaos.plan import KINDS, PlanError
from xscale.launcher.chaos.report import FaultFigures, table
from xscale.launcher.chaos.soak import WARM_MODULES, SoakOptions, run_soak

# The built-in job: a tiny decoder on the copy task, a few milliseconds a step on a CPU.
TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.global_batch_size=4",
        "train.seq_len=16", "train.tensorboard=false", "train.peak_flops=1e12", "data.dataset=copy",
        "data.num_samples=64", "data.eval_fraction=0.0"]


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale chaos", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("config", nargs="?", help="YAML config of the job; omit for a tiny built-in decoder")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the job, e.g. parallel.zero=3")
    parser.add_argument("--faults", type=int, default=20, help="how many faults to inject (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule: kinds, steps, ranks (default 0)")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated fault kinds (default: all that apply): " + ", ".join(KINDS))
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (torchrun --nproc-per-node; default 2)")
    parser.add_argument("--steps", type=int, default=None, help="train steps (default: the fewest the faults need)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="checkpoint.every of the job (default 5)")
    parser.add_argument("--memory-every", type=int, default=0,
                        help="checkpoint.memory_every of the job: a state snapshot in /dev/shm and on a peer rank every "
                             "N steps, resumed when newer than the disk checkpoint (default 0: off)")
    parser.add_argument("--step-timeout", type=float, default=5.0,
                        help="train.step_timeout_s: how soon a stopped worker is noticed (default 5; raise it above "
                             "the first step's time of a larger config)")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts per start (default 3)")
    parser.add_argument("--warm", action="store_true",
                        help="fork the workers from a server that imported torch and xscale's training once "
                             "(xscale.launcher.torchrun --warm): a restart skips the imports")
    parser.add_argument("--output-dir", default="runs/chaos", help="where the runs go (default runs/chaos)")
    parser.add_argument("--out", default=None, help="write the report as JSON here (default <output-dir>/chaos.json)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the fault-free run (no bit-identity check)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up on a run after this many seconds")
    args = parser.parse_intermixed_args(argv)
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # an override where the config would go
        config, overrides = None, [config, *overrides]
    output_dir = Path(args.output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        print(f"xscale chaos: {output_dir} is not empty; name a new --output-dir (the soak resumes nothing)",
              file=sys.stderr)
        return 2
    options = SoakOptions(output_dir=output_dir.resolve(), config=config,
                          overrides=[*([] if config else TINY), *overrides], faults=args.faults,
                          seed=args.seed, kinds=args.kinds.split(",") if args.kinds else None, nproc=args.nproc,
                          steps=args.steps, checkpoint_every=args.checkpoint_every,
                          memory_every=args.memory_every, step_timeout_s=args.step_timeout,
                          max_restarts=args.max_restarts, timeout_s=args.timeout, reference=not args.no_reference,
                          warm=WARM_MODULES if args.warm else None)
    try:
        report = run_soak(options)
    except PlanError as error:
        print(f"xscale chaos: {error}", file=sys.stderr)
        return 2
    report["machine"] = {"processor": platform.processor() or platform.machine(), "python": platform.python_version()}
    out = Path(args.out) if args.out else output_dir / "chaos.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(table([FaultFigures(**figures) for figures in report["faults"]]))
    print(summary_lines(report["summary"]))
    print(f"report: {out}")
    summary = report["summary"]
    healthy = summary["recovered"] == summary["faults"] and summary.get("bit_identical", True)
    return 0 if healthy else 1


def summary_lines(summary: dict) -> str:
    lines = [f"{summary['recovered']}/{summary['faults']} faults recovered, {summary['jobs_started']} job starts, "
             f"{summary['steps']} steps in {summary['wall_s']:.0f} s; median lost per fault "
             f"{_seconds(summary['median_lost_s'])} s; goodput {100 * summary['goodput']:.1f}%"
             + (f" (fault-free run: {100 * summary['reference_goodput']:.1f}% in {summary['reference_wall_s']:.0f} s)"
                if "reference_goodput" in summary else "")]
    if summary["median_restart_parts_s"]:
        lines.append("median restart: " + ", ".join(f"{part} {seconds:.1f} s"
                                                   for part, seconds in summary["median_restart_parts_s"].items()))
    for intervention in summary["interventions"]:
        lines.append(f"soak intervention: {intervention}")
    if "bit_identical" in summary:
        verdict = "bit-identical to" if summary["bit_identical"] else "DIFFERENT from"
        lines.append(f"final state (step {summary['final_step']}, model and optimizer shards) {verdict} the fault-free "
                     f"run's; steps missing: {len(summary['steps_missing'])}; steps whose loss differs: "
                     f"{len(summary['loss_mismatch_steps'])}")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"
