"""``xscale bench NAME``: runs one of the benchmarks in :mod:`xscale.bench`, which print ratios against baselines
measured in the same run."""

from __future__ import annotations

import importlib
import sys

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.commands.parser import print_command_help
from xscale.config.check import closest
from xscale.launcher.cpu_allocator import keep_freed_memory

BENCHMARKS = {
    "train": "xscale vs Hugging Face GPT-2, same shape: step time and memory",
    "attention": "every attention core against naive softmax attention and SDPA, over sequence lengths",
    "kernels": "every fused op against its PyTorch reference",
    "moe": "the MoE layer against DeepSpeed's and a dense FFN",
    "parallel": "training throughput of parallel layouts relative to one process",
    "collectives": "gloo's all-gather and reduce-scatter against xscale's direct transfers",
    "optimizer": "AdamW's fused, per-parameter and foreach updates on one model's parameters",
    "dropout": "the layout-independent dropout against nn.Dropout",
    "memory": "each rank's predicted peak memory against the measured one, per layout",
    "plan": "the planner's predicted step time and memory per layout against measured ones, after a calibration",
    "published": "the planner's predictions for published large-scale runs against their reported throughput",
    "fp8": "the same training run in bf16 and in fp8 (torchao float8 linears): tokens/s ratio and loss",
    "lra": "LRA-style accuracy table (ListOps, byte matching, Pathfinder) of every encoder attention kind",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print_command_help("xscale bench", "Benchmarks, each printing ratios against baselines measured in the same "
                           "run. xscale bench BENCHMARK --help describes each one's options.", "benchmarks", BENCHMARKS)
        return 0
    if not argv:
        print(f"xscale bench: name a benchmark: {', '.join(BENCHMARKS)} (see xscale bench --help)", file=sys.stderr)
        return 2
    if argv[0] not in BENCHMARKS:
        print(f"xscale bench: unknown benchmark '{argv[0]}'{closest(argv[0], BENCHMARKS)}; benchmarks: "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    # What the trainer does on CPU, for every workload of the run alike (XSCALE_SYSTEM_MALLOC=1: leave malloc).
    keep_freed_memory()
    module = importlib.import_module(f"xscale.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)
