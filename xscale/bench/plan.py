"""``xscale bench plan``: the planner's predictions against this machine, in one run.

First the machine is calibrated (:func:`xscale.bench.calibrate.measure_machine`, up to the most processes a layout
uses); then every layout of :data:`LAYOUTS` (data parallelism with ZeRO 0-3, tensor parallelism with sequence
parallelism, pipelines under 1F1B, GPipe and interleaved 1F1B, expert parallelism with data parallelism, their
compositions, gradient accumulation and full recomputation, over 1, 2 and 4 processes) trains a small decoder (its
MoE variant for the expert-parallel layouts and their data-parallel baseline) in fresh local processes, one thread
each, and is predicted by the planner (:class:`xscale.estimate.search.Planner`) with that calibrated cluster:

* step time: the median over ``--steps`` timed steps (after ``--warmup``) of the trainer's whole step without the
  machine's other jobs (:mod:`xscale.bench.contention`), the slowest rank's: wall time less the run-queue wait, but
  never less than every rank's CPU time in the step over the cores (with more processes than cores a rank's wait
  is partly its siblings' turn, which the layout really pays and the calibrated ``concurrent_devices``
  predicts); the wall-clock median is printed beside it. Every layout runs once per ``--passes`` (all layouts, then all again) and keeps its
  fastest pass's median: a busy spell of the machine slows one pass. Predicted: :func:`xscale.estimate.step_time.step_time`'s total;
* peak memory per rank: the peak resident set over the one right after the imports, over the warm-up steps (at
  least 2: the optimizer's moments exist from the second), freed blocks returned to the kernel
  (:func:`~xscale.launcher.cpu_allocator.return_freed_memory`) so that the resident set follows the live tensors;
  the largest rank's. The timed steps come after, with the trainer's own allocator setting
  (:func:`~xscale.launcher.cpu_allocator.keep_freed_memory`). Predicted: the planner's peak (tensors) plus the
  calibrated ``runtime_memory_mib``.

Summary: Spearman's rank correlation of predicted and measured tokens/s, the median |predicted / measured - 1| of
step time, the memory ratios' range, and where the planner's first choice among the dense model's layouts (the
highest predicted tokens/s; ties to the simpler layout) lands against the best measured of them.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from xscale.bench.calibrate import cpu_name, measure_machine
from xscale.bench.contention import dedicated_seconds, uncontended_seconds
from xscale.bench.memory import QUIET, peak_memory, reset_peak_memory
from xscale.bench.spread import spearman
from xscale.commands.parity import PARITY_SETTINGS, run_local
from xscale.commands.parser import CommandParser
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.estimate.cluster import cluster_from_dict
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.search import Planner, rank_key
from xscale.launcher.cpu_allocator import keep_freed_memory, return_freed_memory
from xscale.train.trainer import Trainer

# ~3.2M parameters: 4 blocks of 0.6M, embedding and head 1M each
MODEL = ["model.vocab_size=4000", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.tie_embeddings=false", "train.global_batch_size=16", "train.seq_len=128", "data.dataset=copy",
         "data.num_samples=4096", "data.eval_fraction=0.0"]
# The MoE variant (~8.2M parameters, 4.3M of them experts): blocks 2 and 4 with 4 Switch experts of the FFN's size
MOE_MODEL = ["model.moe.num_experts=4", "model.moe.every=2"]


@dataclass(frozen=True)
class BenchLayout:
    """One layout of the bench, on the dense model or on its MoE variant."""

    layout: Layout
    moe: bool = False

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def model_overrides(self) -> list[str]:
        return list(MOE_MODEL) if self.moe else []

    def overrides(self) -> list[str]:
        return [*self.model_overrides(), *layout_overrides(self.layout)]

    def describe(self) -> str:
        return f"{'moe ' if self.moe else ''}{self.layout.describe()}"


LAYOUTS = tuple(BenchLayout(layout) for layout in (
    Layout(micro_batch=16),
    Layout(micro_batch=4, microbatches=4),
    Layout(micro_batch=16, checkpointing="full"),
    *(Layout(dp=2, zero_stage=stage, micro_batch=8) for stage in (0, 1, 2, 3)),
    Layout(dp=2, zero_stage=3, micro_batch=8, checkpointing="full"),
    Layout(dp=4, micro_batch=4),
    Layout(dp=4, zero_stage=3, micro_batch=4),
    Layout(tp=2, micro_batch=16, sequence_parallel=True),
    Layout(tp=2, dp=2, micro_batch=8, sequence_parallel=True),
    Layout(pp=2, micro_batch=4, microbatches=4, schedule="1f1b"),
    Layout(pp=2, micro_batch=8, microbatches=2, schedule="gpipe"),
    Layout(pp=2, micro_batch=4, microbatches=4, schedule="interleaved_1f1b", stages_per_rank=2),
    Layout(pp=2, dp=2, micro_batch=4, microbatches=2, schedule="1f1b"),
)) + tuple(BenchLayout(layout, moe=True) for layout in (
    Layout(dp=2, micro_batch=8),
    Layout(dp=2, ep=2, micro_batch=8),
    Layout(dp=4, ep=2, zero_stage=1, micro_batch=4),
))


def layout_overrides(layout: Layout) -> list[str]:
    """The layout's :meth:`~xscale.estimate.layout.Layout.overrides` as ``key=value`` strings."""
    return [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in layout.overrides().items()]


def _measure_rank(config: Config, warmup: int, steps: int) -> dict[str, float]:
    """On every rank: the median step seconds on dedicated cores and wall-clock, and the peak resident bytes over
    the post-import baseline."""
    torch.set_num_threads(1)
    return_freed_memory()
    baseline = reset_peak_memory("cpu")
    trainer = Trainer(config)
    for _ in range(max(warmup, 2)):  # the second step holds the optimizer's moments too
        trainer.train_step()
    peak = float(peak_memory("cpu") - baseline)
    os.environ.pop("XSCALE_SYSTEM_MALLOC", None)  # time the steps with the trainer's own allocator setting
    keep_freed_memory()
    trainer.train_step()
    walls, seconds = [], []
    world = dist.get_world_size() if dist.is_initialized() else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for _ in range(steps):
        cpu = time.process_time()
        wall, dedicated = dedicated_seconds(trainer.train_step)
        run_cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(run_cpu)  # every rank's CPU time in the step, after the timed region
        walls.append(wall)
        seconds.append(uncontended_seconds(wall, dedicated, float(run_cpu), cores))
    return {"seconds": statistics.median(seconds), "wall": statistics.median(walls), "peak": peak}


def run_layouts(layouts: list[BenchLayout], warmup: int, steps: int, passes: int, quick: bool,
                overrides: list[str]) -> tuple[dict, list[dict]]:
    """Calibrate, then measure and predict every layout: (the cluster file's mapping, one row per layout)."""
    processes = max(2, max(bench.world_size for bench in layouts))
    calibrated = measure_machine(processes, quick)
    cluster = cluster_from_dict(calibrated, "calibration")
    base = [*MODEL, *PARITY_SETTINGS, *QUIET, *overrides, f"train.steps={warmup + steps + 1}"]
    shapes = {moe: model_shape(load_config_from_cli(None, [*base, *BenchLayout(Layout(), moe).model_overrides()]))
              for moe in {bench.moe for bench in layouts}}
    rows = []
    runs: dict[int, list[list[dict]]] = {index: [] for index in range(len(layouts))}
    with tempfile.TemporaryDirectory(prefix="xscale-bench-plan-") as scratch:
        for attempt in range(passes):  # every layout once per pass: a busy spell of the machine hits one pass
            for index, bench in enumerate(layouts):
                config = load_config_from_cli(None, [*base, *bench.overrides(),
                                                     f"train.output_dir={Path(scratch) / f'{attempt}-{index}'}"])
                runs[index].append(run_local(_measure_rank, bench.world_size, config, warmup, steps))
        for index, bench in enumerate(layouts):
            layout, shape = bench.layout, shapes[bench.moe]
            plan = Planner(shape, cluster, layout.world_size).predict(layout)
            fastest = min(runs[index], key=lambda ranks: max(rank["seconds"] for rank in ranks))
            measured = max(rank["seconds"] for rank in fastest)
            wall = max(rank["wall"] for rank in fastest)
            peak = max(rank["peak"] for attempt in runs[index] for rank in attempt)
            rows.append({"layout": bench, "procs": layout.world_size, "plan": plan,
                         "predicted_s": plan.step.total, "measured_s": measured, "wall_s": wall,
                         "predicted_tokens_per_s": plan.tokens_per_s,
                         "measured_tokens_per_s": shape.global_batch * shape.seq_len / measured,
                         "predicted_peak": plan.peak_bytes, "measured_peak": peak})
    return calibrated, rows


def summary(rows: list[dict]) -> dict[str, float]:
    """Spearman of tokens/s, median step-time error, memory ratio range, first choice vs best measured (among the
    dense model's layouts: the planner chooses a layout for one model)."""
    step_errors = [abs(row["predicted_s"] / row["measured_s"] - 1) for row in rows]
    memory = [row["predicted_peak"] / row["measured_peak"] for row in rows]
    dense = [row for row in rows if not getattr(row["layout"], "moe", False)] or rows
    first = min(dense, key=lambda row: rank_key(row["plan"]))
    best = max(row["measured_tokens_per_s"] for row in dense)
    return {"spearman": spearman([row["predicted_tokens_per_s"] for row in rows],
                                 [row["measured_tokens_per_s"] for row in rows]),
            "median_step_error": statistics.median(step_errors),
            "memory_low": min(memory), "memory_high": max(memory),
            "first_choice": first["layout"].describe(),
            "first_vs_best": first["measured_tokens_per_s"] / best}


def report(calibrated: dict, rows: list[dict], figures: dict[str, float]) -> None:
    print(f"xscale bench plan: {cpu_name()}, {calibrated['concurrent_devices']} cores, one thread per process; "
          f"calibrated in this run: {calibrated['peak_tflops']['fp32'] * 1e3:.0f} GFLOP/s fp32 peak, "
          f"{calibrated['memory_bandwidth_gbs']:.0f} GB/s, runtime {calibrated['runtime_memory_mib']:.0f} MiB/process")
    width = max(len(row["layout"].describe()) for row in rows)
    print(f"{'layout':<{width}} {'procs':>5} {'pred s':>7} {'meas s':>7} {'wall s':>7} {'err':>6} {'pred tok/s':>10} "
          f"{'meas tok/s':>10} {'pred MiB':>8} {'meas MiB':>8} {'ratio':>6}  predicted split: compute/comm/bubble/optim")
    for row in rows:
        step = row["plan"].step
        print(f"{row['layout'].describe():<{width}} {row['procs']:>5} {row['predicted_s']:>7.3f} "
              f"{row['measured_s']:>7.3f} {row['wall_s']:>7.3f} {row['predicted_s'] / row['measured_s'] - 1:>+6.0%} "
              f"{row['predicted_tokens_per_s']:>10,.0f} {row['measured_tokens_per_s']:>10,.0f} "
              f"{row['predicted_peak'] / 2**20:>8.1f} {row['measured_peak'] / 2**20:>8.1f} "
              f"{row['predicted_peak'] / row['measured_peak']:>6.2f}  {step.compute:.3f}/"
              f"{step.exposed_communication:.3f}/{step.bubble:.3f}/{step.optimizer:.3f}")
    print(f"{len(rows)} layouts: Spearman (tokens/s) {figures['spearman']:.2f}; median step-time error "
          f"{figures['median_step_error']:.1%}; memory predicted / measured {figures['memory_low']:.2f}-"
          f"{figures['memory_high']:.2f}; planner's first choice ({figures['first_choice']}) at "
          f"{figures['first_vs_best']:.0%} of the best measured tokens/s")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the bench model")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per layout (default 7, --quick 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--passes", type=int, default=None, help="runs of every layout (default 2, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="quick calibration, 3 timed steps, one pass")
    parser.add_argument("--max-processes", type=int, default=4, help="only the layouts of at most this many")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the layouts whose description contains one of these (e.g. 'moe' 'pp=2')")
    parser.add_argument("--cluster-out", default=None, help="also write the calibrated cluster file here")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 7)
    args.passes = args.passes if args.passes is not None else (1 if args.quick else 2)
    layouts = [bench for bench in LAYOUTS if bench.world_size <= args.max_processes
               and (args.only is None or any(text in bench.describe() for text in args.only))]
    if steps < 1 or args.warmup < 0 or args.passes < 1 or not layouts:
        print(f"xscale bench plan: need --steps >= 1, --warmup >= 0, --passes >= 1, --max-processes >= 1 and an "
              f"--only that matches a layout (got {steps}, {args.warmup}, {args.passes}, {args.max_processes}, "
              f"{args.only})", file=sys.stderr)
        return 2
    try:
        calibrated, rows = run_layouts(layouts, args.warmup, steps, args.passes, args.quick, args.overrides)
    except (ConfigError, ValueError) as error:
        print(f"xscale bench plan: {error}", file=sys.stderr)
        return 2
    if args.cluster_out:
        Path(args.cluster_out).write_text(yaml.safe_dump(calibrated, sort_keys=False, default_flow_style=None))
    report(calibrated, rows, summary(rows))
    return 0
