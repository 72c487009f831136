"""``xscale bench fp8``: one training run in bf16 and again in fp8 (``train.precision=fp8``), back to back on one
device: tokens/s and loss, side by side.

Both runs are ``xscale train`` on one process with the same config, seed, data and steps; only the precision
differs (the fp8 run's block linears go through torchao's float8 training: :mod:`xscale.models.float8`). Prints
each run's median step time over the steps after ``--warmup`` (compilation and warm-up excluded), the fp8/bf16
tokens/s ratio, and the mean loss over the last ``--tail`` steps of each with their relative difference; ``--out``
keeps both runs' folders (metrics.jsonl: the loss curves). A GPU with FP8 tensor cores is where the ratio means
something; on the CPU, torch's reference FP8 GEMM checks the numbers, not the speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.train.trainer import Trainer

PRECISIONS = ("bf16", "fp8")


def _arguments(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="xscale bench fp8", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs (model shape, data, batch)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the step time")
    parser.add_argument("--tail", type=int, default=20, help="last steps whose mean loss is compared")
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    parser.add_argument("--compile", action="store_true", help="train.compile=true for both runs")
    parser.add_argument("--out", default=None, help="keep both runs' folders here (default: a temporary folder)")
    return parser.parse_args(argv)


def run_records(config: str | None, overrides: list[str], output_dir: Path) -> list[dict]:
    """Train one run to its end and return its per-step metrics records (metrics.jsonl)."""
    Trainer(load_config_from_cli(config, [*overrides, f"train.output_dir={output_dir}"])).fit()
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/loss" in record and "perf/step_seconds" in record]


def summarise(records: list[dict], warmup: int, tail: int) -> dict[str, float]:
    timed = [record["perf/step_seconds"] for record in records if record["step"] > warmup]
    return {"step_seconds": statistics.median(timed), "tail_loss": statistics.fmean(
        record["train/loss"] for record in records[-tail:]), "first_loss": records[0]["train/loss"]}


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.steps <= args.warmup or args.tail < 1 or args.tail > args.steps:
        print(f"xscale bench fp8: --steps {args.steps} must exceed --warmup {args.warmup}, and --tail {args.tail} "
              "must be between 1 and --steps")
        return 2
    common = [*args.overrides, f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
              "train.plot=false", "train.progress=false", "checkpoint.resume=none", "checkpoint.every=-1",
              f"train.compile={str(args.compile).lower()}", f"train.fp8_recipe={args.recipe}"]
    with tempfile.TemporaryDirectory(prefix="xscale-bench-fp8-") as scratch:
        root = Path(args.out or scratch)
        summary = {}
        for precision in PRECISIONS:
            try:
                records = run_records(args.config, [*common, f"train.precision={precision}"], root / precision)
            except ConfigError as error:
                print(f"xscale bench fp8: {error}")
                return 2
            summary[precision] = summarise(records, args.warmup, args.tail)
    tokens = load_config_from_cli(args.config, common).train
    tokens_per_step = tokens.global_batch_size * tokens.seq_len
    print(f"{args.steps} steps of {tokens.global_batch_size}x{tokens.seq_len} tokens, step time over steps "
          f"{args.warmup + 1}-{args.steps}, loss over the last {args.tail}; fp8 recipe {args.recipe}, "
          f"{'compiled blocks' if args.compile else 'eager'}")
    for precision, figures in summary.items():
        print(f"{precision:5s} {tokens_per_step / figures['step_seconds']:12.1f} tokens/s  (median step "
              f"{figures['step_seconds']:.4f} s)  loss {figures['first_loss']:.4f} -> {figures['tail_loss']:.4f}")
    bf16, fp8 = summary["bf16"], summary["fp8"]
    print(f"ratio fp8 / bf16 tokens/s: {bf16['step_seconds'] / fp8['step_seconds']:.3f}x")
    print(f"loss fp8 vs bf16 over the last {args.tail} steps: {fp8['tail_loss'] / bf16['tail_loss'] - 1:+.2%}")
    if args.out:
        print(f"runs (metrics.jsonl: the loss curves): {root / 'bf16'}, {root / 'fp8'}")
    return 0
