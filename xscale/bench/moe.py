"""``xscale bench moe``: our MoE layer vs DeepSpeed's MoE layer and vs a dense FFN, same machine, one run.

Forward+backward of the same tokens (fp32, or under bf16 autocast with ``--dtype bf16``) through:
  * xscale ``MoELayer`` (Switch top-1, or with ``--top-k 2`` GShard top-2 with both choices dispatched; stacked
    experts, sort-based dispatch, grouped expert GEMMs);
  * DeepSpeed ``deepspeed.moe.layer.MoE`` at the same config (same k and capacity factor, token dropping,
    ``use_rts=False``, top-2 without the sampled second expert) with the same weights;
  * a dense FFN with the MoE's active parameters per token (k experts' FFNs: hidden k x ``--hidden``), the
    compute floor.
In one process (a 1-process gloo group for DeepSpeed; nccl on a GPU) on ``--device`` (cpu, cuda, or auto: cuda when
there is one) and, with ``--ep 2`` (CPU only; the default there), under expert parallelism over 2 gloo processes (each
with half the tokens, half the experts), xscale and DeepSpeed again.

A fourth workload, xscale's expert FFNs alone on the routed rows, splits the MoE/dense gap into the cost of
E smaller GEMMs and that of routing. DeepSpeed's time over the dense FFN's is printed as the ceiling of the
xscale/DeepSpeed ratio: the experts do the dense FFN's FLOPs (fewer when tokens drop), so an MoE layer faster than
the dense FFN is out of reach, and xscale/DeepSpeed cannot exceed DeepSpeed/dense.

Workloads are timed in alternating rounds (A B C A B C ...) after one warm-up each, between GPU synchronizations on
CUDA, and the median per workload is reported, so machine noise hits them alike. Figures: tokens/s, xscale/DeepSpeed tokens/s
(target: at least the ceiling / 1.15) and MoE/dense step time (target <= 1.15x). On a shared machine, run with
``OMP_WAIT_POLICY=PASSIVE``: spinning OpenMP threads of an oversubscribed CPU measure the scheduler instead.
Every process keeps freed memory mapped, as the trainer does on CPU (:mod:`xscale.launcher.cpu_allocator`;
``XSCALE_SYSTEM_MALLOC=1`` measures with glibc's defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from xscale.bench.device import bench_device, synchronize
from xscale.commands.parser import CommandParser
from xscale.config.schema import Component, ModelConfig, MoEConfig
from xscale.launcher.cpu_allocator import keep_freed_memory
from xscale.launcher.env import free_port
from xscale.models.ffn import build_ffn
from xscale.models.moe import build_moe
from xscale.parallel.expert import apply_expert_parallel
from xscale.runtime import StepContext

DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # --dtype: the autocast dtype (None: fp32 throughout)


class _DeepSpeedExpert(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


def layer_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(d_model=args.d_model, d_ff=args.hidden, ffn="gelu", moe=MoEConfig(
        num_experts=args.experts, router="switch" if args.top_k == 1 else "gshard", top_k=args.top_k,
        second_expert_policy="all", capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
        min_capacity=4, drop_policy="position"))


def _autocast(x: torch.Tensor, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None)


def _step(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor, context: StepContext | None = None,
          dtype: torch.dtype | None = None) -> Callable[[], None]:
    """One forward + backward; ``context``: an expert-parallel layer's (its ep group's token exchange); ``dtype``:
    the forward's autocast dtype (None: none)."""
    def run() -> None:
        with _autocast(x, dtype):
            out = module(x) if context is None else module(x, context=context)
        out = out[0] if isinstance(out, tuple) else out
        (out * upstream).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None
    return run


def _experts_step(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor,
                  dtype: torch.dtype | None = None) -> Callable[[], None]:
    """The MoE layer's expert FFNs alone on its routed rows (already sorted by expert): no router, no gather or
    combine. Its time over the dense FFN's is the cost of E smaller GEMMs; the MoE step's over it, of routing."""
    with torch.no_grad():
        layer(x)
    counts = [int(count) for count in layer.metrics["tokens_per_expert"]]
    copies = -(-sum(counts) // x.shape[0])  # top-k routes up to k rows per token
    rows = x.detach().repeat(copies, 1)[: sum(counts)].clone().requires_grad_()
    rows_upstream = upstream.repeat(copies, 1)[: sum(counts)]

    def run() -> None:
        with _autocast(rows, dtype):
            out = layer.experts(rows, counts)
        (out * rows_upstream).sum().backward()
        layer.experts.zero_grad(set_to_none=True)
        rows.grad = None
    return run


def time_alternating(runs: dict[str, Callable[[], None]], rounds: int,
                     sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds per call of each workload, the workloads alternating every round (after one warm-up).

    ``sync`` runs before and after each timed call (a barrier under expert parallelism).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def deepspeed_available() -> bool:
    try:
        import deepspeed.moe.layer  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _single_process_group(device: torch.device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _deepspeed_layer(ours: nn.Module, args: argparse.Namespace, ep_size: int = 1, ep_rank: int = 0) -> nn.Module:
    """DeepSpeed's MoE with our router weights and experts (rank ``ep_rank``'s share of them under ep)."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    theirs = MoE(args.d_model, _DeepSpeedExpert(args.d_model, args.hidden), num_experts=args.experts,
                 ep_size=ep_size, k=args.top_k, capacity_factor=args.capacity_factor,
                 eval_capacity_factor=args.capacity_factor, min_capacity=4, drop_tokens=True, use_rts=False,
                 top2_2nd_expert_sampling=False)
    if ep_size > 1:
        # deepspeed.comm wraps the process group already running. Its shared-memory all-reduce kernel (a C++
        # build of minutes on first use) serves only inference all-reduces, not the MoE's all-to-all: skipped.
        with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):
            deepspeed.init_distributed(dist_backend="gloo")
        theirs.set_deepspeed_parallelism()
    local = args.experts // ep_size
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for index, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            source = index if ours.experts.num_experts == local else ep_rank * local + index
            expert.w_in.weight.copy_(ours.experts.w_in.weight[source])
            expert.w_out.weight.copy_(ours.experts.w_out.weight[source])
    return theirs.to(ours.router.weight.device)


def single_process(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of xscale's MoE, the dense FFN and (when installed) DeepSpeed's MoE, in this process, on
    ``args.device``."""
    device, dtype = bench_device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    ours = build_moe(layer_config(args), 0).to(device)
    dense = build_ffn(Component("gelu"), args.d_model, args.top_k * args.hidden, False, 0.0).to(device)
    x = torch.randn(args.tokens, args.d_model).to(device).requires_grad_()
    upstream = torch.randn(args.tokens, args.d_model).to(device)
    runs = {"xscale_moe": _step(ours, x, upstream, dtype=dtype), "dense_ffn": _step(dense, x, upstream, dtype=dtype),
            "xscale_experts_only": _experts_step(ours, x, upstream, dtype)}
    with contextlib.ExitStack() as stack:
        if deepspeed_available():
            stack.enter_context(_single_process_group(device))
            runs["deepspeed_moe"] = _step(_deepspeed_layer(ours, args), x, upstream, dtype=dtype)
        seconds = time_alternating(runs, args.rounds, sync=lambda: synchronize(device))
    ours(x)
    seconds["dropped_fraction"] = float(ours.metrics["dropped_fraction"])
    return seconds


def _ep_worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    keep_freed_memory()  # a spawned process: the allocator setting of the parent, as in the trainer's ranks
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        ours = build_moe(layer_config(args), 0)
        runs = {}
        tokens = args.tokens // 2
        torch.manual_seed(1 + rank)
        x = torch.randn(tokens, args.d_model, requires_grad=True)
        upstream = torch.randn(tokens, args.d_model)
        dtype = DTYPES[args.dtype]
        if deepspeed_available():
            runs["deepspeed_moe"] = _step(_deepspeed_layer(ours, args, ep_size=2, ep_rank=rank), x, upstream,
                                          dtype=dtype)
        place = apply_expert_parallel(ours, dist.group.WORLD)
        runs["xscale_moe"] = _step(ours, x, upstream, place(StepContext()), dtype)
        seconds = time_alternating(runs, args.rounds, sync=dist.barrier)
        if rank == 0:
            results.update(seconds)
    finally:
        dist.destroy_process_group()


def expert_parallel(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds (rank 0, between barriers) of xscale's and DeepSpeed's MoE at ep=2 over 2 gloo processes."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ep_worker, args=(free_port(), args, results), nprocs=2, join=True)
        return dict(results)


def run(args: argparse.Namespace) -> dict:
    """Every figure of the bench: seconds per workload and the target ratios (see the module docstring)."""
    single = single_process(args)
    figures: dict = {"single": single, "ratios": {"moe_over_dense_step_time": single["xscale_moe"] / single["dense_ffn"]}}
    figures["ratios"]["experts_only_over_dense_step_time"] = single["xscale_experts_only"] / single["dense_ffn"]
    if "deepspeed_moe" in single:
        figures["ratios"]["xscale_over_deepspeed_tokens_per_s"] = single["deepspeed_moe"] / single["xscale_moe"]
        figures["ratios"]["deepspeed_over_dense_step_time"] = single["deepspeed_moe"] / single["dense_ffn"]
    if args.ep == 2:
        ep = expert_parallel(args)
        figures["ep2"] = ep
        figures["ratios"]["ep2_over_single_tokens_per_s"] = single["xscale_moe"] / ep["xscale_moe"]
        if "deepspeed_moe" in ep:
            figures["ratios"]["ep2_xscale_over_deepspeed_tokens_per_s"] = ep["deepspeed_moe"] / ep["xscale_moe"]
    return figures


def report(figures: dict, args: argparse.Namespace) -> None:
    single, ratios = figures["single"], figures["ratios"]
    device = bench_device(args.device)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"{torch.get_num_threads()} threads, malloc "
             f"{'keeping freed memory' if keep_freed_memory() else 'as the system set it'}")
    print(f"MoE layer: {args.tokens} tokens, d_model {args.d_model}, hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.top_k}, capacity factor {args.capacity_factor} (dropped {single['dropped_fraction']:.3f}), "
          f"{args.dtype}, {where}, forward+backward, median of {args.rounds} alternating rounds")
    rows = [(f"{name} (1 process)", value) for name, value in single.items() if name != "dropped_fraction"]
    rows += [(f"{name} (ep=2, 2 processes)", value) for name, value in figures.get("ep2", {}).items()]
    for name, seconds in rows:
        print(f"  {name:32s} {seconds * 1e3:9.1f} ms {args.tokens / seconds:12.0f} tokens/s")
    if not deepspeed_available():
        print("deepspeed is not installed: DeepSpeed skipped, xscale vs dense only (pip install -e .[deepspeed])")
    labels = {"xscale_over_deepspeed_tokens_per_s": "xscale/DeepSpeed tokens/s, 1 process (target >= ceiling / 1.15)",
              "ep2_xscale_over_deepspeed_tokens_per_s": "xscale/DeepSpeed tokens/s, ep=2",
              "deepspeed_over_dense_step_time": "  ceiling of that ratio for an MoE no faster than the dense FFN "
                                                "(DeepSpeed/dense step time)",
              "moe_over_dense_step_time": "MoE/dense FFN step time (target <= 1.15x)",
              "experts_only_over_dense_step_time": "  of which the expert FFNs alone on their routed rows "
                                                   "(experts only/dense step time)",
              "ep2_over_single_tokens_per_s": "xscale ep=2 / 1 process tokens/s"}
    for key, label in labels.items():
        if key in ratios:
            print(f"{label}: {ratios[key]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1, choices=(1, 2), help="1: Switch; 2: GShard top-2")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=15, help="timed forward+backward rounds per workload")
    parser.add_argument("--ep", type=int, default=None, choices=(1, 2), help="2: also compare under expert parallel "
                        "over 2 gloo processes (CPU only; default: 2 on the CPU, 1 on a GPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="fp32, or bf16 autocast on every side")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("xscale bench moe: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    on_gpu = bench_device(args.device).type == "cuda"
    if args.ep == 2 and on_gpu:
        print("xscale bench moe: --ep 2 runs on the CPU only (2 gloo processes); on a GPU use --ep 1, or "
              "--device cpu for expert parallelism", file=sys.stderr)
        return 2
    if args.ep is None:
        args.ep = 1 if on_gpu else 2
    if args.experts % args.ep or args.tokens % 2:
        print(f"xscale bench moe: --experts {args.experts} must split over --ep {args.ep} and --tokens be even",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    report(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
