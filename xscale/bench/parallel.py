"""``xscale bench parallel``: training throughput of parallel layouts relative to one process, in one run.

Each layout trains the same model in fresh local processes (the machine's cores shared out between them); the
figure is the median step time after warm-up, as tokens/s and as a ratio to the single-process run measured in
the same invocation. Pipeline layouts also report the measured bubble fraction next to (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from xscale.config import Config, ConfigError, load_config_from_cli
from xscale.parity import PARITY_SETTINGS, layout_overrides, run_local, world_size_of

DEFAULT_LAYOUTS = ("dp_shard=2", "dp_shard=2,zero_stage=1", "dp_shard=2,zero_stage=2", "dp_shard=2,zero_stage=3",
                   "tp=2,dp_shard=1", "pp=2,dp_shard=1,microbatches=4,pp_schedule=gpipe",
                   "pp=2,dp_shard=1,microbatches=4,pp_schedule=1f1b")
MODEL = ["model.vocab_size=4000", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "train.global_batch_size=16", "train.seq_len=128", "data.dataset=copy", "data.num_samples=4096",
         "data.eval_fraction=0.0"]


def _measure(config: Config, warmup: int, steps: int) -> dict:
    from xscale.train.trainer import Trainer

    trainer = Trainer(config)
    for _ in range(warmup):
        trainer.train_step()
    times, bubbles = [], []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        bubble = getattr(trainer.engine, "last_bubble_fraction", None)
        if bubble is not None:
            bubbles.append(bubble)
    return {"seconds": statistics.median(times), "bubble": statistics.median(bubbles) if bubbles else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xscale bench parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (default: a 4-layer, 256-wide decoder)")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    base = ([] if args.config else MODEL) + [*args.overrides, *PARITY_SETTINGS, "train.steps=1000"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="xscale-bench-parallel-") as scratch:
        try:
            for index, layout in enumerate(["single", *args.layouts]):
                config = load_config_from_cli(args.config, [*base, *layout_overrides(layout),
                                                            f"train.output_dir={Path(scratch) / str(index)}"])
                world_size = world_size_of(config)
                result = run_local(_measure, world_size, config, args.warmup, args.steps)[0]
                theory = None
                if config.parallel.pp > 1:
                    p, m = config.parallel.pp, config.parallel.microbatches
                    theory = (p - 1) / (m + p - 1)
                rows.append((layout, world_size, result["seconds"], result["bubble"], theory))
        except ConfigError as error:
            print(f"xscale bench parallel: {error}", file=sys.stderr)
            return 2
    tokens = config.train.global_batch_size * config.train.seq_len
    single = rows[0][2]
    print(f"{'layout':<48} {'procs':>5} {'step s':>8} {'tokens/s':>10} {'vs single':>9} {'bubble':>7} {'(p-1)/(m+p-1)':>13}")
    for layout, world_size, seconds, bubble, theory in rows:
        bubble_text = f"{bubble:.3f}" if bubble is not None else "-"
        theory_text = f"{theory:.3f}" if theory is not None else "-"
        print(f"{layout:<48} {world_size:>5} {seconds:>8.3f} {tokens / seconds:>10,.0f} {single / seconds:>8.2f}x "
              f"{bubble_text:>7} {theory_text:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
