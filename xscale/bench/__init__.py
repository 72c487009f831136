"""``xscale bench NAME``: benchmarks that print ratios against baselines measured in the same run."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("train", "attention", "kernels", "moe", "parallel", "dropout")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: xscale bench {{{'|'.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"xscale.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)
