"""``xscale bench moe``: our MoE layer vs DeepSpeed's MoE layer and vs a dense FFN, same machine, one run.

Three forward+backward workloads on the same tokens (fp32), timed in alternating rounds so machine noise
hits each alike:
  * xscale ``MoELayer`` (Switch top-1, stacked experts, sort-based dispatch);
  * DeepSpeed ``deepspeed.moe.layer.MoE`` at the same config (k=1, same capacity factor, token dropping,
    ``use_rts=False``) with the same weights, in a 1-process gloo group;
  * a dense FFN with the MoE's active parameters per token (one expert's FFN), the compute floor.
Prints tokens/s, xscale/DeepSpeed and MoE/dense step-time ratios. ``--ep 2`` also times the layer under
expert parallelism over 2 gloo processes (each with half the tokens) against 1 process.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from xscale.config import ModelConfig, MoEConfig
from xscale.models.ffn import build_ffn
from xscale.models.moe import build_moe


class _DeepSpeedExpert(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


def layer_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(d_model=args.d_model, d_ff=args.hidden, ffn="gelu", moe=MoEConfig(
        num_experts=args.experts, router="switch", top_k=1, capacity_factor=args.capacity_factor,
        eval_capacity_factor=args.capacity_factor, min_capacity=4, drop_policy="position"))


def _step(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * upstream).sum().backward()
        module.zero_grad(set_to_none=True)
    return run


def _time(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each workload, alternating workloads every round (after one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def _single_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _deepspeed_layer(ours: nn.Module, args: argparse.Namespace) -> nn.Module:
    from deepspeed.moe.layer import MoE

    theirs = MoE(args.d_model, _DeepSpeedExpert(args.d_model, args.hidden), num_experts=args.experts, ep_size=1,
                 k=1, capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                 min_capacity=4, drop_tokens=True, use_rts=False)
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for e, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            expert.w_in.weight.copy_(ours.experts.w_in.weight[e])
            expert.w_out.weight.copy_(ours.experts.w_out.weight[e])
    return theirs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ep_worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    from xscale.parallel.expert import apply_expert_parallel

    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        layer = build_moe(layer_config(args), 0)
        apply_expert_parallel(layer, dist.group.WORLD)
        tokens = args.tokens // 2
        x = torch.randn(tokens, args.d_model, requires_grad=True)
        upstream = torch.randn(tokens, args.d_model)
        run = _step(layer, x, upstream)
        run()
        times = []
        for _ in range(args.rounds):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times.append(time.perf_counter() - start)
        if rank == 0:
            results["ep2"] = statistics.median(times)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xscale bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=5, help="timed forward+backward rounds per workload")
    parser.add_argument("--ep", type=int, default=1, choices=(1, 2), help="2: also time expert parallel over 2 processes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    ours = build_moe(layer_config(args), 0)
    dense = build_ffn("gelu", args.d_model, args.hidden, False, 0.0)
    x = torch.randn(args.tokens, args.d_model, requires_grad=True)
    upstream = torch.randn(args.tokens, args.d_model)
    runs = {"xscale_moe": _step(ours, x, upstream), "dense_ffn": _step(dense, x, upstream)}
    with contextlib.ExitStack() as stack:
        try:
            import deepspeed.moe.layer  # noqa: F401
        except ImportError:
            print("deepspeed is not installed: skipping the DeepSpeed comparison (pip install -e .[deepspeed])")
        else:
            stack.enter_context(_single_process_group())
            runs["deepspeed_moe"] = _step(_deepspeed_layer(ours, args), x, upstream)
        seconds = _time(runs, args.rounds)

    ours(x)
    print(f"MoE layer: {args.tokens} tokens, d_model {args.d_model}, hidden {args.hidden}, {args.experts} experts, "
          f"top-1, capacity factor {args.capacity_factor} (dropped {ours.metrics['dropped_fraction'].item():.3f}), "
          f"fp32, {torch.get_num_threads()} threads, forward+backward, median of {args.rounds}")
    for name, value in seconds.items():
        print(f"  {name:14s} {value * 1e3:9.1f} ms   {args.tokens / value:12.0f} tokens/s")
    if "deepspeed_moe" in seconds:
        print(f"xscale/deepspeed tokens/s: {seconds['deepspeed_moe'] / seconds['xscale_moe']:.2f}x (target >= 1.5x)")
    print(f"MoE/dense step time: {seconds['xscale_moe'] / seconds['dense_ffn']:.2f}x (target <= 1.3x)")

    if args.ep == 2:
        import torch.multiprocessing as mp

        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_ep_worker, args=(_free_port(), args, results), nprocs=2, join=True)
            ep_seconds = results["ep2"]
        print(f"  xscale_moe ep=2 {ep_seconds * 1e3:9.1f} ms   {args.tokens / ep_seconds:12.0f} tokens/s "
              f"(2 gloo processes, {args.tokens // 2} tokens each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
