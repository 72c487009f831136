"""``xscale parity CONFIG [overrides] --layouts L1 L2 ...``: loss curves of parallel layouts vs one process.

A layout is a comma-separated list of ``parallel.*`` settings, e.g. ``dp_shard=2,zero_stage=3`` or
``tp=2,sequence_parallel=true``; its process count is the product of its degrees (dp_shard counts as 1
unless given). Each layout trains the same
config for ``--steps`` steps in fresh local processes (gloo on CPU, nccl on GPUs) and its per-step losses are
compared with the single-process run's: the largest relative difference must stay within ``--rtol``.
Dropout masks are functions of each element's global coordinates (:mod:`xscale.models.dropout`), so runs
with ``model.dropout`` and ``model.attention_dropout`` compare too, in every attention core (a core whose
masks depended on the layout would be refused, see :func:`check_dropout_comparable`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.commands.parser import CommandParser
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.launcher.env import close_distributed
from xscale.launcher.local import start_local
from xscale.models.registry import ATTENTION
from xscale.train.trainer import Trainer

PARITY_SETTINGS = ("train.eval_every=0", "train.plot=false", "train.tensorboard=false", "train.progress=false",
                   "train.log_every=1000000", "train.precision=fp32", "checkpoint.resume=none")
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class LayoutResult:
    layout: str
    world_size: int
    losses: list[float]
    max_relative_difference: float

    def passed(self, rtol: float) -> bool:
        return self.max_relative_difference <= rtol


def layout_overrides(layout: str) -> list[str]:
    """``"tp=2,dp_shard=2"`` -> ``["parallel.tp=2", "parallel.dp_shard=2"]`` (``single`` -> [])."""
    if layout in ("", "single"):
        return []
    overrides = []
    for item in layout.split(","):
        if "=" not in item:
            raise ConfigError(f"layout item '{item}' must look like name=value (e.g. tp=2)")
        overrides.append(f"parallel.{item.strip()}")
    return overrides


def world_size_of(config: Config) -> int:
    """Processes a layout runs on: the product of its degrees (dp_shard=-1, "fill the world", counts as 1)."""
    parallel = config.parallel
    return math.prod(max(getattr(parallel, name), 1) for name in DEGREES)


def _run_rank(local_rank: int, world_size: int, port: int, function: Callable[..., Any], args: tuple,
              result_dir: str) -> None:
    # Every rank is a client of the store the parent holds open (torchelastic's agent store): no rank binds a port
    # picked beforehand, which another test process could take in between and so join this run's rendezvous.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(local_rank),
                       "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the cores shared out, none oversubscribed
    finished = False
    try:
        result = function(*args)
        Path(result_dir, f"rank{local_rank}.json").write_text(json.dumps(result))
        finished = True
    finally:
        close_distributed(meet_first=finished)


def run_local(function: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``function(*args)`` in ``world_size`` new local processes with a torchrun-style environment
    (the function initialises the process group, e.g. through the Trainer); returns each rank's JSON result."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    # The rendezvous store listens on a port the OS picks for it, open until every rank has exited.
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(minutes=5),
                     wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="xscale-local-") as scratch:
        start_local(_run_rank, world_size, (world_size, store.port, function, args, scratch))
        return [json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _train(config: Config) -> list[float]:
    return Trainer(config).fit()["losses"]


def train_losses(config: Config, world_size: int) -> list[float]:
    """Per-step training losses of ``config`` run by ``world_size`` fresh local processes."""
    return run_local(_train, world_size, config)[0]


def max_relative_difference(reference: Sequence[float], losses: Sequence[float]) -> float:
    if len(reference) != len(losses):
        return math.inf
    return max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, losses)), default=0.0)


def check_dropout_comparable(layout: str, config: Config) -> None:
    """Refuse a comparison whose dropout masks depend on the layout, so losses could not match: attention cores
    flagged ``rng_dropout`` (none of the registered ones now: every core draws hashed, layout-independent masks)."""
    model = config.model
    layers = model.total_layers
    rng_kinds = sorted({kind for kind in map(model.attention.kind_for_layer, range(layers))
                        if ATTENTION.get(kind).rng_dropout})
    if model.attention_dropout and rng_kinds:
        raise ConfigError(f"layout {layout}: attention {', '.join(rng_kinds)} draws attention dropout from torch's "
                          "RNG, so its masks depend on the layout; compare with model.attention_dropout=0")


def compare_layouts(config_path: str | None, overrides: Sequence[str], layouts: Sequence[str], steps: int,
                    output_dir: str | Path) -> tuple[list[float], list[LayoutResult]]:
    """Run the single-process reference and every layout; returns (reference losses, results)."""
    base = [*overrides, *PARITY_SETTINGS, f"train.steps={steps}"]
    reference_config = load_config_from_cli(config_path, [*base, f"train.output_dir={Path(output_dir) / 'single'}"])
    configs = [load_config_from_cli(config_path, [*base, *layout_overrides(layout),
                                                  f"train.output_dir={Path(output_dir) / f'layout{index}'}"])
               for index, layout in enumerate(layouts)]
    for layout, config in zip(layouts, configs):
        check_dropout_comparable(layout, config)
    reference = train_losses(reference_config, 1)
    results = []
    for layout, config in zip(layouts, configs):
        losses = train_losses(config, world_size_of(config))
        results.append(LayoutResult(layout, world_size_of(config), losses,
                                    max_relative_difference(reference, losses)))
    return reference, results


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    parser.add_argument("--layouts", nargs="+", required=True, help="e.g. dp_shard=2 tp=2 'pp=2,microbatches=2'")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--output-dir", default=None, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xscale-parity-runs-") as scratch:
        try:
            reference, results = compare_layouts(args.config, args.overrides, args.layouts, args.steps,
                                                 args.output_dir or scratch)
        except ConfigError as error:
            print(f"xscale parity: {error}", file=sys.stderr)
            return 2
    print(f"{'layout':<40} {'procs':>5} {'max rel diff':>13}  result")
    print(f"{'single':<40} {1:>5} {0.0:>13.2e}  reference (last loss {reference[-1]:.6f})")
    for result in results:
        verdict = "ok" if result.passed(args.rtol) else f"FAIL (> {args.rtol:g})"
        print(f"{result.layout:<40} {result.world_size:>5} {result.max_relative_difference:>13.2e}  {verdict}")
    return 0 if all(result.passed(args.rtol) for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
