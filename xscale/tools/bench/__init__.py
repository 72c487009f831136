"""``xscale bench NAME``: benchmarks that print ratios against baselines measured in the same run."""

from __future__ import annotations

import importlib
import sys

from xscale.launcher.cpu_allocator import keep_freed_memory

BENCHMARKS = ("train", "attention", "kernels", "moe", "parallel", "dropout")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: xscale bench {{{'|'.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    # What the trainer does on CPU, for every workload of the run alike (XSCALE_SYSTEM_MALLOC=1: leave malloc).
    keep_freed_memory()
    module = importlib.import_module(f"xscale.tools.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)
