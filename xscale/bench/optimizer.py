"""``xscale bench optimizer``: AdamW's update modes (``train.optimizer_foreach``) on one model's parameters, one run.

Each mode steps its own copy of the same parameters with the same gradients, through the trainer's optimizer
(:func:`xscale.train.optim.build_optimizer`: weight decay on matrices only), in alternating rounds after one warm-up
step each: ``fused`` (torch's kernel, what ``auto`` picks where torch has one), ``per_parameter`` and ``foreach``.
Figures: median milliseconds per step, each mode's time over the fused update's, and each mode's largest difference
from the per-parameter update after all the rounds (they compute the same update).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from xscale.commands.parser import CommandParser
from xscale.config.load import load_config_from_cli
from xscale.models import build_model
from xscale.train.optim import build_optimizer

MODES = {"fused": "auto", "per_parameter": False, "foreach": True}
# The model of ``xscale bench parallel``: a 4-layer decoder of width 256 (5M parameters).
MODEL = ["model.vocab_size=4000", "model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4"]


def _copies(parameters: list[torch.Tensor], seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """A copy of ``parameters`` and the gradients every mode gets (a fixed draw)."""
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=generator) for p in parameters]
    return [torch.nn.Parameter(p.detach().clone()) for p in parameters], grads


def measure(overrides: list[str], rounds: int) -> tuple[dict[str, dict[str, float]], int]:
    """Per mode: median seconds per step and its largest difference from the per-parameter update; and the number of
    parameters stepped."""
    config = load_config_from_cli(None, [*MODEL, *overrides])
    source = [p for p in build_model(config.model, "cpu").parameters() if p.requires_grad]
    runs = {}
    for name, setting in MODES.items():
        params, grads = _copies(source, config.train.seed)
        optimizer = build_optimizer(params, dataclasses.replace(config.train, optimizer_foreach=setting))
        for param, grad in zip(params, grads):
            param.grad = grad
        runs[name] = (params, optimizer)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds + 1):  # the first round warms up
        for name, (_, optimizer) in runs.items():
            start = time.perf_counter()
            optimizer.step()
            if index:
                seconds[name].append(time.perf_counter() - start)
    reference = runs["per_parameter"][0]
    figures = {name: {"seconds": statistics.median(seconds[name]),
                      "difference": max(float((p - q).detach().abs().max()) for p, q in zip(params, reference))}
               for name, (params, _) in runs.items()}
    return figures, sum(p.numel() for p in source)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="model.*=value settings over the default 4-layer decoder")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    figures, total = measure(args.overrides, args.rounds)
    print(f"AdamW step over {total / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads, median of "
          f"{args.rounds} alternating rounds")
    fused = figures["fused"]["seconds"]
    for name, figure in figures.items():
        print(f"  {name:<14} {figure['seconds'] * 1e3:8.2f} ms  {figure['seconds'] / fused:5.2f}x fused's time  "
              f"max difference from per_parameter {figure['difference']:.1e}")
    return 0
