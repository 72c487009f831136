"""``xscale bench parallel``: training throughput of parallel layouts relative to one process, in one run,
and the measured pipeline bubble next to the theoretical (p-1)/(m+p-1).

Each layout trains the same model in fresh local processes (the machine's cores shared out between them);
the figure is the median step time over the timed steps after warm-up, as tokens/s and as a ratio to the
single-process run measured in the same invocation.

Bubble (pipeline layouts): the fraction of a rank's schedule step in which it computes nothing. Every
compute action the schedule runs (each stage's forward, backward and weight backward of a microbatch, and
the last stage's loss) is timed through :attr:`PipelineSchedule.wrap_compute`; the rest of the step (waiting
for activations or gradients, sends, receives, bookkeeping) is idle. Per rank and step,
``bubble = 1 - compute seconds / schedule step seconds`` (``PipelineSchedule.last_step_seconds``); the table
gives the median over the timed steps, averaged over the pp ranks, and the ranks' own values. The theory
(Huang et al. 2019; Narayanan et al. 2021) assumes equal stages and free communication. The last stage also
holds the output head and the loss; with ``parallel.pp_split`` unset the blocks are split to balance a cost model
(:mod:`xscale.parallel.pipeline.cost`), and each rank's compute seconds per step are printed as its check: unequal
stages show as a rank that idles while it waits for the slower one. Communication (gloo copies) counts as idle.

Peers (:mod:`xscale.bench.peers`): each pure data-parallel layout also times torch's
``DistributedDataParallel`` (DDP, ZeRO-1/2) or FSDP2 ``fully_shard`` (ZeRO-3) in the same processes, on the
same model and batches, its steps interleaved with xscale's; ``xscale/peer`` is the median over the step pairs of
peer step time / xscale step time (each pair run back to back, so a slow drift of the machine cancels), printed with
its interquartile range, the run's noise. The *ceiling* column is peer step time / local step time, the local step
being the peer's with no gradient communication at all: no data-parallel implementation's xscale/peer can exceed it,
so it says how much room a layout had to be ahead of its peer.

On a shared machine, run with ``OMP_WAIT_POLICY=PASSIVE`` (spinning OpenMP threads of an oversubscribed
CPU measure the scheduler instead), and compare only figures of one invocation.
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from xscale.bench.peers import LOCAL, build_peer, peer_for
from xscale.bench.spread import median_and_quartiles
from xscale.commands.parity import PARITY_SETTINGS, layout_overrides, run_local, world_size_of
from xscale.commands.parser import CommandParser
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.parallel.checks import resolve_layout
from xscale.parallel.pipeline import ideal_bubble
from xscale.train.trainer import Trainer

PIPELINES = (*(f"pp=2,dp_shard=1,microbatches={m},pp_schedule={schedule}"
                for schedule in ("gpipe", "1f1b") for m in (2, 4, 8)),
             # the head split over the ranks (vocabulary stages) under ZB-V: the bubble target at 4 layers
             *(f"pp=2,dp_shard=1,microbatches={m},pp_schedule=zero_bubble,pp_stages_per_rank=2,pp_vocab_parallel=true"
               for m in (4, 8)))
DEFAULT_LAYOUTS = ("dp_shard=2", "dp_shard=2,zero_stage=1", "dp_shard=2,zero_stage=2", "dp_shard=2,zero_stage=3",
                   "tp=2,dp_shard=1", *PIPELINES)
MODEL = ["model.vocab_size=4000", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "train.global_batch_size=16", "train.seq_len=128", "data.dataset=copy", "data.num_samples=4096",
         "data.eval_fraction=0.0"]


class ComputeClock:
    """Adds up the wall time spent inside the callables it wraps (the schedule's compute actions)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, action: Callable) -> Callable:
        @functools.wraps(action)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return action(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def bubble_fraction(compute_seconds: float, step_seconds: float) -> float:
    """The idle share of a schedule step: 1 - compute / step."""
    return 1.0 - compute_seconds / step_seconds


def peer_of(config: Config) -> str | None:
    """The torch peer a layout is timed against: pure data parallelism only (no tp, pp, cp or ep)."""
    parallel = config.parallel
    if parallel.tp * parallel.pp * parallel.cp * parallel.ep > 1 or parallel.dp_replicate * parallel.dp_shard <= 1:
        return None
    return peer_for(parallel.zero_stage)


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _measure(config: Config, warmup: int, steps: int, peer: str | None, ceiling: bool = True) -> dict:
    """On every rank: median step seconds (the trainer's whole step), in a pipeline the median bubble, and with a
    ``peer`` its median step seconds on the same batches and the communication-free local step's (the ceiling,
    :mod:`xscale.bench.peers`), the three steps interleaved (which goes first rotates)."""
    trainer = Trainer(config)
    pipeline = trainer.model.pipeline
    clock = ComputeClock()
    if pipeline is not None:
        pipeline.wrap_compute = clock.wrap  # before the first step builds the schedule
    peer_steps = {}
    if peer is not None:
        dp = trainer.mesh["dp"]
        for name in (peer, LOCAL) if ceiling else (peer,):
            peer_steps[name] = build_peer(name, config, dp.get_group(), dp, trainer.device,
                                          trainer.model.micro_batch_size)
    times, peer_times, pair_ratios, ceilings, bubbles, computes = [], [], [], [], [], []
    for index in range(warmup + steps):
        clock.seconds = 0.0
        batch = trainer.next_batch()  # the batch the trainer's step reads next: the peers train on it too
        actions = {"xscale": trainer.train_step,
                   **{name: functools.partial(step, batch) for name, step in peer_steps.items()}}
        names = list(actions)
        shift = index % len(names)
        seconds_of = {name: _timed(actions[name]) for name in names[shift:] + names[:shift]}
        if index < warmup:
            continue
        seconds = seconds_of["xscale"]
        times.append(seconds)
        if peer is not None:
            peer_times.append(seconds_of[peer])
            pair_ratios.append(seconds_of[peer] / seconds)
            if LOCAL in seconds_of:
                ceilings.append(seconds_of[peer] / seconds_of[LOCAL])
        if pipeline is not None:
            bubbles.append(bubble_fraction(clock.seconds, pipeline.last_step_seconds))
            computes.append(clock.seconds)
    return {"seconds": statistics.median(times), "bubble": statistics.median(bubbles) if bubbles else None,
            "compute": statistics.median(computes) if computes else None,
            "peer_seconds": statistics.median(peer_times) if peer_times else None,
            "vs_peer": median_and_quartiles(pair_ratios),
            "ceiling": statistics.median(ceilings) if ceilings else None}


def measure_layouts(config_path: str | None, overrides: list[str], layouts: list[str], warmup: int,
                    steps: int, peers: bool = True, ceiling: bool = True) -> list[dict]:
    """One row per layout ("single" first): procs, step seconds, tokens/s, ratio to single, bubbles, and (``peers``)
    the torch peer's tokens/s, xscale / peer and (``ceiling``) peer / local step."""
    base = ([] if config_path else MODEL) + [*overrides, *PARITY_SETTINGS, "train.steps=1000"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="xscale-bench-parallel-") as scratch:
        for index, layout in enumerate(["single", *layouts]):
            config = load_config_from_cli(config_path, [*base, *layout_overrides(layout),
                                                        f"train.output_dir={Path(scratch) / str(index)}"])
            world_size = world_size_of(config)
            _, config = resolve_layout(config, world_size)  # a copy with an unset parallel.microbatches resolved
            peer = peer_of(config) if peers else None
            ranks = run_local(_measure, world_size, config, warmup, steps, peer, ceiling)
            bubbles = [rank["bubble"] for rank in ranks if rank["bubble"] is not None]
            parallel = config.parallel
            rows.append({
                "layout": layout, "procs": world_size, "seconds": ranks[0]["seconds"],
                "tokens_per_s": config.train.global_batch_size * config.train.seq_len / ranks[0]["seconds"],
                "rank_bubbles": bubbles, "rank_compute": [rank["compute"] for rank in ranks if rank["compute"] is not None],
                "bubble": statistics.mean(bubbles) if bubbles else None,
                "theory": ideal_bubble(parallel.pp, parallel.microbatches) if parallel.pp > 1 else None,
            })
            tokens = config.train.global_batch_size * config.train.seq_len
            peer_seconds = ranks[0]["peer_seconds"]
            ratio = ranks[0]["vs_peer"]
            rows[-1].update({"peer": peer, "peer_tokens_per_s": tokens / peer_seconds if peer_seconds else None,
                             "vs_peer": ratio[0] if ratio else None, "vs_peer_quartiles": ratio[1:] if ratio else None,
                             "ceiling": ranks[0]["ceiling"]})
    for row in rows:
        row["vs_single"] = rows[0]["seconds"] / row["seconds"]
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'layout':<48} {'procs':>5} {'step s':>8} {'tokens/s':>9} {'vs single':>9} {'peer':>9} "
          f"{'peer tok/s':>10} {'xscale/peer (IQR)':>19} {'ceiling':>7} {'bubble':>7} {'(p-1)/(m+p-1)':>13}  per-rank bubble (compute s)")
    for row in rows:
        bubble = f"{row['bubble']:.3f}" if row["bubble"] is not None else "-"
        theory = f"{row['theory']:.3f}" if row["theory"] is not None else "-"
        ranks = " ".join(f"{value:.3f} ({compute:.3f})" for value, compute in zip(row["rank_bubbles"], row["rank_compute"]))
        peer = row["peer"] or "-"
        peer_tokens = f"{row['peer_tokens_per_s']:,.0f}" if row["peer_tokens_per_s"] else "-"
        vs_peer = (f"{row['vs_peer']:.2f}x ({row['vs_peer_quartiles'][0]:.2f}-{row['vs_peer_quartiles'][1]:.2f})"
                   if row["vs_peer"] else "-")
        ceiling = f"{row['ceiling']:.2f}x" if row["ceiling"] else "-"
        print(f"{row['layout']:<48} {row['procs']:>5} {row['seconds']:>8.3f} {row['tokens_per_s']:>9,.0f} "
              f"{row['vs_single']:>8.2f}x {peer:>9} {peer_tokens:>10} {vs_peer:>19} {ceiling:>7} {bubble:>7} {theory:>13}  {ranks}")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (default: a 4-layer, 256-wide decoder; overrides alone apply to it)")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="skip torch DDP / FSDP2 on the data-parallel layouts")
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="skip the communication-free local step (it holds a third, unsharded copy of the model)")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:  # overrides of the built-in model: no config file given
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        rows = measure_layouts(args.config, args.overrides, args.layouts, args.warmup, args.steps, args.peers,
                              args.ceiling)
    except ConfigError as error:
        print(f"xscale bench parallel: {error}", file=sys.stderr)
        return 2
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
