"""``xscale bench train``: xscale vs Hugging Face GPT2LMHeadModel, same shape, same precision, same machine, one run.

Both models train (forward + backward + AdamW step) on the same random tokens, in fp32 or under bf16 autocast
(``--precision``), each with its framework's default AdamW: torch's fused kernel for both (transformers' Trainer
defaults to ``adamw_torch_fused`` from torch 2.8 on; xscale's ``train.optimizer_foreach=auto``); the benchmark
alternates between them so that machine noise hits both, and prints tokens/s, the ratio xscale / HF, and each one's
MFU against this device's peak (:mod:`xscale.train.peak_flops`: the best of several GEMM shapes in that dtype, cached;
or ``--peak-flops``), on a GPU also against its datasheet dense peak and with each model's peak memory.
``--device``: cpu, cuda, or auto (cuda when there is one); one code path, GPU steps timed between synchronizations.
``--compile``: each Transformer block of both models compiled (``nn.Module.compile``, xscale's
``train.compile=true``).
``--profile``: a torch.profiler breakdown of one xscale step (the top ops by self time and the share of the step spent
in matrix products).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from xscale.bench.device import bench_device, synchronize
from xscale.bench.spread import median_and_quartiles
from xscale.commands.parser import CommandParser
from xscale.config.schema import Config, TrainConfig
from xscale.interop.hf.load import model_config_from_hf, state_dict_from_hf
from xscale.models import build_model
from xscale.models.parameters import count_parameters
from xscale.parallel.model import ParallelModel
from xscale.parallel.parallelize import compile_blocks
from xscale.train.bf16_support import bf16_warning
from xscale.train.metrics import flops_per_token
from xscale.train.optim import build_optimizer
from xscale.train.peak_flops import datasheet_peak_flops, peak_flops
from xscale.train.step import forward_backward_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def _hf_step(model, optimizer, tokens: torch.Tensor, autocast_dtype: torch.dtype | None) -> None:
    with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _xscale_step(model: ParallelModel, optimizer, tokens: torch.Tensor) -> None:
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    forward_backward_step(model, {"input_ids": tokens, "labels": labels})
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def profile_breakdown(step: Callable[[], None], top: int = 10) -> tuple[list[tuple[str, float]], float]:
    """One run of ``step`` under torch.profiler: the ``top`` ops by self CPU time (name, seconds) and the share of
    all ops' self time spent in matrix products (mm, addmm, bmm, baddbmm)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    totals = [(event.key, event.self_cpu_time_total / 1e6) for event in profiler.key_averages()]
    totals.sort(key=lambda item: -item[1])
    everything = sum(seconds for _, seconds in totals)
    gemm = sum(seconds for name, seconds in totals if name in GEMM_OPS)
    return totals[:top], gemm / everything if everything else 0.0


def time_steps(runs: dict[str, Callable[[], None]], steps: int, warmup: int, device: torch.device,
               ) -> tuple[dict[str, list[float]], dict[str, tuple[int, int]]]:
    """Seconds of each of ``steps`` rounds per run, the runs alternating (after ``warmup`` untimed rounds); on CUDA
    also each run's memory: (allocated before its steps, the peak allocated during them), in bytes."""
    on_cuda = device.type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in runs}
    memory: dict[str, tuple[int, int]] = {}
    for _ in range(warmup):
        for step in runs.values():
            step()
    for _ in range(steps):
        for name, step in runs.items():
            synchronize(device)
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
            if on_cuda:
                this_step = (resident, torch.cuda.max_memory_allocated(device))
                memory[name] = max(memory.get(name, this_step), this_step, key=lambda pair: pair[1])
    return times, memory


def _arguments(argv: list[str] | None):
    parser = CommandParser(prog="xscale bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model (after --warmup ones)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model first (3 on a GPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--precision", choices=tuple(DTYPES), default="fp32",
                        help="fp32, or bf16 autocast (fp32 weights) for both models")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="FLOP/s for MFU (default: the measured, cached best GEMM rate in --precision's dtype)")
    parser.add_argument("--compile", action="store_true",
                        help="compile each Transformer block of both models (xscale's train.compile=true)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler breakdown of one xscale step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.peak_flops is not None and not args.peak_flops > 0:
        print(f"xscale bench train: --peak-flops {args.peak_flops} must be a positive FLOP/s figure")
        return 2
    if args.steps < 1 or args.warmup < 0:
        print(f"xscale bench train: --steps {args.steps} must be at least 1 and --warmup {args.warmup} at least 0")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("xscale bench train: --device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
        return 2
    device = bench_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        print("xscale bench train needs transformers (pip install -e .[dev])")
        return 2
    if warning := bf16_warning(args.precision, device.type):
        print(warning)
    autocast_dtype = DTYPES[args.precision] if args.precision == "bf16" else None

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0)
    hf_config._attn_implementation = "sdpa"  # on CUDA, SDPA runs its flash / memory-efficient kernels
    with device:  # built (and initialised) on the device: a 1B model's CPU init would take longer than its steps
        hf = transformers.GPT2LMHeadModel(hf_config)
    hf = hf.to(device).train()
    config = model_config_from_hf(hf_config.to_dict())
    ours = build_model(config, device)
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config, "gpt2"))
    ours.train()
    if args.compile:
        for block in hf.transformer.h:
            block.compile()
        compile_blocks(ours)
    parallel = ParallelModel([ours], micro_batch_size=args.batch, autocast_dtype=autocast_dtype)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)
    our_optimizer = build_optimizer(ours.parameters(), TrainConfig(lr=1e-4))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq)).to(device)
    tokens_per_step = args.batch * args.seq

    runs = {"huggingface": lambda: _hf_step(hf, hf_optimizer, tokens, autocast_dtype),
            "xscale": lambda: _xscale_step(parallel, our_optimizer, tokens)}
    times, memory = time_steps(runs, args.steps, args.warmup, device)

    dtype = DTYPES[args.precision]
    peak = args.peak_flops or peak_flops(dtype, str(device))
    datasheet = None if args.peak_flops else datasheet_peak_flops(dtype, device)
    count = count_parameters(Config(model=config))
    flops = flops_per_token(config, args.seq, count.matmul_per_token)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"GPT-2-shaped: {args.layers} layers, width {args.width}, {args.heads} heads, vocab {args.vocab}, "
          f"batch {args.batch}x{args.seq}, {args.precision}, {'compiled blocks' if args.compile else 'eager'}, "
          f"{where}")
    source = "given" if args.peak_flops else "best of several GEMM shapes, cached"
    print(f"{args.precision} matmul peak: {peak / 1e9:.1f} GFLOP/s ({source})")
    if datasheet is not None:
        print(f"{args.precision} datasheet dense peak: {datasheet / 1e12:.1f} TFLOP/s")
    rates = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rates[name] = tokens_per_step / median
        measured = f"{rates[name] * flops / peak:.1%}"
        mfu = (f"MFU {measured}" if datasheet is None
               else f"MFU {rates[name] * flops / datasheet:.1%} of datasheet, {measured} of measured GEMM peak")
        print(f"{name:12s} {rates[name]:10.1f} tokens/s  (median step {median:.3f} s over {len(samples)})  {mfu}")
    for name, (resident, peak_bytes) in memory.items():
        print(f"{name:12s} peak memory in its steps {peak_bytes / 2**30:.2f} GiB: {resident / 2**30:.2f} GiB resident "
              f"(both models and optimizers) + {(peak_bytes - resident) / 2**30:.2f} GiB for its step")
    print(f"ratio xscale / huggingface: {rates['xscale'] / rates['huggingface']:.3f}x")
    if len(times["xscale"]) > 1:
        # each round's pair ran back to back, so its ratio sees the same machine: their spread is the run's noise
        median, low, high = median_and_quartiles([hf / ours for hf, ours in zip(times["huggingface"],
                                                                                 times["xscale"])])
        print(f"  per-round ratios: median {median:.3f}x, interquartile range {low:.3f}-{high:.3f}x")
    if args.profile:
        top, gemm_share = profile_breakdown(runs["xscale"])
        print(f"profile of one xscale step: matrix products (mm/addmm/bmm) {gemm_share:.1%} of op self time; top ops:")
        for name, seconds in top:
            print(f"  {name:<40} {1e3 * seconds:9.2f} ms")
    return 0
