"""``xscale bench kernels``: every fused op against its PyTorch reference, forward + backward, in one run.

    xscale bench kernels                      # GPT-2-small shapes: 8192 tokens, hidden 768, vocab 50257
    xscale bench kernels --ops linear_cross_entropy --csv out/kernels.csv
    xscale bench kernels --device cuda --dtype bf16  # + the references under torch.compile (on by default on CUDA)

For each op the reference (``xscale.ops.reference`` and the ``*_reference`` functions: what
``train.kernels=torch`` runs) and the fused path (what ``xscale.ops`` dispatches to under ``--backend``,
default auto) run on the same inputs and the same upstream gradients. The "path" column names what
actually ran: on CUDA the Triton kernels; on CPU the PyTorch path, which is the reference itself except
for the linear cross-entropy (chunked over tokens, logits never whole) and block-sparse attention
(listed key blocks gathered, no Tq x Tk scores), so the other CPU ratios only show the timing noise. ``--backend triton`` with ``TRITON_INTERPRET=1`` runs the kernels in Triton's CPU
interpreter: a correctness run, its timings mean nothing.

Measured per op and implementation, each outside the others' runs:
  * check: outputs and input gradients of the fused path against the reference's, max |error| over the
    reference's largest magnitude (fp32 1e-5, bf16 2e-2); a failed check makes the command exit 1;
  * time: median of ``--repeats`` forward + backward runs, reference and fused alternating (CUDA synchronized
    before and after each run);
  * compiled: the same reference function under ``torch.compile(fn, dynamic=False)``, compiled and run twice
    before any timing, then timed in the same alternating rounds: "vs compiled" is compiled time over fused
    time. On by default on CUDA; on CPU only with ``--compile`` (inductor's C++ builds: 3-12 s per op on 2
    cores). An op that fails to compile says so in that column and the others go on;
  * peak memory: the most bytes allocated above the level at the start of forward + backward. On CUDA
    ``torch.cuda.max_memory_allocated``; on CPU the allocation events of torch's profiler
    (``profile_memory=True``: every allocation and free of c10's CPU allocator, transient buffers inside
    ops included, summed in time order). As an OS-level cross-check on Linux the CSV also holds the peak
    resident-set growth (VmHWM reset through /proc/self/clear_refs) of the timed runs, which also sees
    memory that libraries allocate outside torch.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xscale import ops
from xscale.bench.device import bench_device, synchronize
from xscale.commands.parser import CommandParser
from xscale.ops import dispatch, reference
from xscale.ops.block_sparse_attention import block_sparse_attention_reference
from xscale.ops.moe_permute import Permutation, permute_reference, plan_permutation, unpermute_reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CROSS_ENTROPY_MEMORY_TARGET = 3.0  # the chunked loss must need >= 3x less peak memory than CE(h W^T)
FIELDS = ["op", "shape", "dtype", "device", "path", "reference_ms", "fused_ms", "speedup", "reference_peak_mib",
          "fused_peak_mib", "memory_ratio", "reference_rss_mib", "fused_rss_mib", "max_error", "check",
          "compiled_ms", "vs_compiled", "compiled_peak_mib", "compile", "compile_s"]


@dataclass
class Case:
    """One op: leaves that get gradients, the two implementations over them, and the tensors dispatch sees."""

    name: str
    shape: str
    leaves: list[torch.Tensor]
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    fused: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    apex_has_op: bool = False
    extra: list[torch.Tensor] = field(default_factory=list)
    backend: str = "auto"  # train.kernels for the fused column


def glu_hidden(hidden: int) -> int:
    """The GLU FFN width of ``ModelConfig.ffn_hidden``: 8/3 of the model width, rounded up to 64."""
    return 64 * ((int(8 * hidden / 3) + 63) // 64)


def local_layout(length: int, block: int, device: torch.device) -> ops.BlockLayout:
    """Causal local attention: each query block sees itself and the block before (Child et al. 2019)."""
    n_blocks = -(-length // block)
    rows = torch.arange(n_blocks, device=device)
    index = torch.stack([rows, (rows - 1).clamp_min(0)], dim=1).to(torch.int32)
    count = torch.where(rows > 0, 2, 1).to(torch.int32)
    return ops.build_layout(index, count, block, length, length)


def build_cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[Case]:
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, like: torch.dtype | None = None) -> torch.Tensor:
        values = torch.randn(*shape, generator=generator) * scale + shift
        return values.to(device=device, dtype=like or dtype).requires_grad_()

    def norm_weight() -> torch.Tensor:
        return randn(hidden, scale=0.1, shift=1.0, like=torch.float32)  # float32, as autocast keeps parameters

    tokens, hidden, vocab, eps = args.tokens, args.hidden, args.vocab, 1e-5
    backend = args.backend
    head_dim = hidden // args.heads
    ffn = glu_hidden(hidden)
    batch = max(1, tokens // args.seq)
    angles = torch.outer(torch.arange(args.seq, dtype=torch.float32),
                         10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = (torch.cat([angles, angles], -1).cos().to(device), torch.cat([angles, angles], -1).sin().to(device))
    labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    labels[::17] = -100  # padding / prompt tokens the loss ignores
    expert_ids = torch.rand(tokens, args.experts, generator=generator).topk(args.top_k, -1).indices.to(device)
    expert_scale = torch.rand(tokens * args.top_k, 1, generator=generator).to(device=device, dtype=dtype)
    layout = local_layout(args.attention_seq, args.block, device)

    def moe_reference(x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        plan = plan_permutation(expert_ids, args.experts)
        return unpermute_reference(permute_reference(x, plan) * expert_scale, plan, gates)

    def moe_permute_and_scale(x: torch.Tensor) -> tuple[torch.Tensor, Permutation]:
        permuted, plan = ops.moe_permute(x, expert_ids, args.experts, backend=backend)
        return permuted * expert_scale, plan  # the permuted rows die here, as in the reference's expression

    def moe_fused(x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        scaled, plan = moe_permute_and_scale(x)
        return ops.moe_unpermute(scaled, plan, gates, backend=backend)

    attention_shape = (1, args.heads, args.attention_seq, head_dim)
    cases = [
        Case("rms_norm", f"{tokens}x{hidden}", [randn(tokens, hidden), norm_weight()],
             lambda x, w: reference.rms_norm(x, w, eps), lambda x, w: ops.rms_norm(x, w, eps, backend=backend), apex_has_op=True),
        Case("rms_norm_residual", f"{tokens}x{hidden}",
             [randn(tokens, hidden), randn(tokens, hidden), norm_weight()],
             lambda x, r, w: reference.rms_norm_residual(x, r, w, eps),
             lambda x, r, w: ops.rms_norm_residual(x, r, w, eps, backend=backend), apex_has_op=True),
        Case("layer_norm_residual", f"{tokens}x{hidden}",
             [randn(tokens, hidden), randn(tokens, hidden), norm_weight(), randn(hidden, like=torch.float32)],
             lambda x, r, w, b: reference.layer_norm_residual(x, r, w, b, eps),
             lambda x, r, w, b: ops.layer_norm_residual(x, r, w, b, eps, backend=backend), apex_has_op=True),
        Case("swiglu", f"{tokens}x{ffn}", [randn(tokens, ffn), randn(tokens, ffn)],
             lambda g, u: reference.gated_activation(g, u, "silu"), lambda g, u: ops.gated_activation(g, u, "silu", backend=backend)),
        Case("geglu", f"{tokens}x{ffn}", [randn(tokens, ffn), randn(tokens, ffn)],
             lambda g, u: reference.gated_activation(g, u, "gelu"), lambda g, u: ops.gated_activation(g, u, "gelu", backend=backend)),
        Case("rope", f"{batch}x{args.heads}x{args.seq}x{head_dim}", [randn(batch, args.heads, args.seq, head_dim)],
             lambda x: reference.apply_rope(x, cos, sin), lambda x: ops.apply_rope(x, cos, sin, backend=backend), extra=[cos, sin]),
        Case("linear_cross_entropy", f"{tokens}x{hidden} vocab {vocab}"
             + (f" chunks of {args.ce_chunk_tokens}" if args.ce_chunk_tokens else ""),
             [randn(tokens, hidden), randn(vocab, hidden, scale=0.05)],
             lambda h, w: reference.linear_cross_entropy_sum(h, w, labels),
             lambda h, w: ops.linear_cross_entropy_sum(h, w, labels, chunk_tokens=args.ce_chunk_tokens or None,
                                                       backend=backend)),
        Case("moe_permute", f"{tokens}x{hidden} top{args.top_k}/{args.experts}",
             [randn(tokens, hidden), torch.rand(tokens, args.top_k, generator=generator).to(device).requires_grad_()],
             moe_reference, moe_fused),
        Case("block_sparse_attention", f"{'x'.join(map(str, attention_shape))} local/{args.block}",
             [randn(*attention_shape), randn(*attention_shape), randn(*attention_shape)],
             lambda q, k, v: block_sparse_attention_reference(q, k, v, layout, True),
             lambda q, k, v: ops.block_sparse_attention(q, k, v, layout, causal=True, backend=backend)),
    ]
    for case in cases:
        case.backend = backend
    return cases


def path_of(case: Case) -> str:
    """What the fused column runs on these tensors under the case's ``train.kernels`` setting."""
    backend = dispatch.choose_backend(tuple(case.leaves + case.extra), case.backend, apex_has_op=case.apex_has_op)
    if backend == "triton":
        return "triton" if case.leaves[0].is_cuda else "triton (interpreter)"
    if backend == "apex":
        return "apex"
    own_torch_path = {"linear_cross_entropy": "torch chunked", "block_sparse_attention": "torch gathered"}
    if case.name in own_torch_path and case.backend != "torch":
        return own_torch_path[case.name]
    return "torch (= reference)"


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _clear_grads(leaves: list[torch.Tensor]) -> None:
    """Outside the measured region: the step then allocates its gradients instead of replacing old ones."""
    for leaf in leaves:
        leaf.grad = None


def _step(fn: Callable, leaves: list[torch.Tensor], upstream: list[torch.Tensor]) -> None:
    torch.autograd.backward(_as_tuple(fn(*leaves)), upstream)


def peak_cpu_allocation(run: Callable[[], object]) -> int:
    """Most bytes the c10 CPU allocator held above its level when ``run`` started.

    Reads the allocation events (size > 0) and frees (size < 0) of torch's profiler event tree in time
    order; the tree is an experimental torch API, which tests/bench pins down on a known allocation pattern.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def peak_memory(run: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        run()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    return peak_cpu_allocation(run)


class ResidentSetPeak:
    """Growth of the process's peak resident set (VmHWM) over a region; ``start`` is False without Linux's /proc."""

    def __init__(self) -> None:
        self.baseline = 0

    @staticmethod
    def _status_kib(key: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(key))

    def start(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # resets VmHWM to the current VmRSS
            self.baseline = self._status_kib("VmRSS:")
            return True
        except OSError:
            return False

    def growth_bytes(self) -> int:
        return (self._status_kib("VmHWM:") - self.baseline) * 1024


def max_relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for actual, expected in zip(got, want, strict=True):
        scale = max(expected.detach().float().abs().max().item(), 1.0)
        worst = max(worst, (actual.detach().float() - expected.detach().float()).abs().max().item() / scale)
    return worst


def short_reason(error: BaseException) -> str:
    """The exception's type and the first line of its message, at most about 100 characters."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(error).__name__}: {first[:100]}" if first else type(error).__name__


def compile_reference(case: Case, upstream: list[torch.Tensor]) -> tuple[Callable | None, str]:
    """The case's reference under ``torch.compile``, already compiled forward and backward (two untimed steps,
    so neither compilation nor a recompilation lands in a timed run); or None and "compile failed: why"."""
    try:
        compiled = torch.compile(case.reference, dynamic=False)
        for _ in range(2):
            _clear_grads(case.leaves)
            _step(compiled, case.leaves, upstream)
    except Exception as error:  # dynamo / inductor raise many types, and which ops fail varies by torch version
        _clear_grads(case.leaves)
        return None, f"compile failed: {short_reason(error)}"
    return compiled, ""


def measure(case: Case, repeats: int, device: torch.device, dtype: torch.dtype, compiled: bool = False) -> dict:
    """Check, then peak memory, then one untimed round and the timed rounds, alternating which goes first.

    ``compiled``: also the reference under ``torch.compile``, compiled before the memory and timing runs.
    """
    impls = {"reference": case.reference, "fused": case.fused}
    results: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    upstream: list[torch.Tensor] = []
    for name, fn in impls.items():
        _clear_grads(case.leaves)
        outs = _as_tuple(fn(*case.leaves))
        if not upstream:  # the same upstream gradients for both, drawn once
            generator = torch.Generator(device="cpu").manual_seed(1)
            upstream = [torch.randn(o.shape, generator=generator).to(device=o.device, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, upstream)
        results[name] = ([o.detach().clone() for o in outs], [leaf.grad.clone() for leaf in case.leaves])
        del outs
    error = max_relative_error(results["fused"][0] + results["fused"][1],
                               results["reference"][0] + results["reference"][1])
    del results
    row: dict = {"op": case.name, "shape": case.shape, "dtype": str(dtype).removeprefix("torch."),
                 "device": device.type, "path": path_of(case), "max_error": error,
                 "check": "ok" if error <= TOLERANCE[dtype] else "MISMATCH",
                 "compiled_ms": None, "vs_compiled": None, "compiled_peak_mib": None, "compile": "off",
                 "compile_s": None}
    timed = dict(impls)
    if compiled:
        start = time.perf_counter()
        compiled_reference, row["compile"] = compile_reference(case, upstream)
        row["compile_s"] = time.perf_counter() - start
        if compiled_reference is not None:
            timed["compiled"] = compiled_reference
            row["compile"] = "ok"
    for name, fn in timed.items():
        _clear_grads(case.leaves)
        row[f"{name}_peak_mib"] = peak_memory(lambda fn=fn: _step(fn, case.leaves, upstream), device) / 2**20
    times: dict[str, list[float]] = {name: [] for name in timed}
    rss: dict[str, list[int]] = {name: [] for name in timed}
    tracker = ResidentSetPeak()
    for round_index in range(repeats + 1):
        order = list(timed) if round_index % 2 == 0 else list(reversed(timed))
        for name in order:
            _clear_grads(case.leaves)
            tracking = device.type == "cpu" and tracker.start()
            synchronize(device)
            start = time.perf_counter()
            _step(timed[name], case.leaves, upstream)
            synchronize(device)
            if round_index > 0:
                times[name].append(time.perf_counter() - start)
                if tracking:
                    rss[name].append(tracker.growth_bytes())
    for name in impls:
        row[f"{name}_rss_mib"] = max(rss[name]) / 2**20 if rss[name] else math.nan
    for name in timed:
        row[f"{name}_ms"] = statistics.median(times[name]) * 1e3
    _clear_grads(case.leaves)
    row["speedup"] = row["reference_ms"] / row["fused_ms"]
    if row["compiled_ms"] is not None:
        row["vs_compiled"] = row["compiled_ms"] / row["fused_ms"]
    row["memory_ratio"] = row["reference_peak_mib"] / max(row["fused_peak_mib"], 1e-9)
    return row


def _compiled_cells(row: dict) -> str:
    if row["compiled_ms"] is not None:
        return f"{row['compiled_ms']:11.2f} {row['vs_compiled']:10.2f}x"
    return f"{'-':>11s} {'-':>11s}" if row["compile"] == "off" else row["compile"]


def format_table(rows: list[dict]) -> str:
    """speed-up = reference ms / fused ms; vs compiled = compiled reference ms / fused ms (> 1: fused is faster)."""
    header = (f"{'op':24s} {'shape':34s} {'path':21s} {'ref ms':>9s} {'fused ms':>9s} {'speed-up':>8s} "
              f"{'ref MiB':>9s} {'fused MiB':>9s} {'mem ratio':>9s} {'max err':>8s} check "
              f"{'compiled ms':>11s} {'vs compiled':>11s}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:24s} {r['shape']:34s} {r['path']:21s} {r['reference_ms']:9.2f} {r['fused_ms']:9.2f} "
                     f"{r['speedup']:7.2f}x {r['reference_peak_mib']:9.1f} {r['fused_peak_mib']:9.1f} "
                     f"{r['memory_ratio']:8.2f}x {r['max_error']:8.1e} {r['check']:5s} {_compiled_cells(r)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandParser(prog="xscale bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="all", help="comma-separated subset of the op names, or all")
    parser.add_argument("--backend", default="auto", choices=dispatch.BACKENDS, help="train.kernels for the fused side")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time each reference under torch.compile (default: on for cuda, off for cpu)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024, help="sequence length of the RoPE case")
    parser.add_argument("--attention-seq", type=int, default=2048)
    parser.add_argument("--block", type=int, default=64, help="block-sparse attention block size")
    parser.add_argument("--ce-chunk-tokens", type=int, default=0,
                        help="tokens per chunk of the linear cross-entropy (0: its default, ~128 MiB of fp32 logits)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        print(f"--hidden {args.hidden} must split into --heads {args.heads} of an even head dim", file=sys.stderr)
        return 2
    device = bench_device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ops.check_backend(args.backend)
    cases = build_cases(args, device, dtype)
    wanted = [case.name for case in cases] if args.ops == "all" else args.ops.split(",")
    unknown = sorted(set(wanted) - {case.name for case in cases})
    if unknown:
        print(f"unknown ops {unknown}; choose from {', '.join(case.name for case in cases)}", file=sys.stderr)
        return 2
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    print(f"kernel bench: {device.type}, {args.dtype}, train.kernels={args.backend}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.repeats} fwd+bwd; "
          + ("references also under torch.compile(dynamic=False), compiled before timing" if compiled
             else "no torch.compile column (--compile adds it)"))
    rows, failed = [], []
    for case in cases:
        if case.name not in wanted:
            continue
        try:
            rows.append(measure(case, args.repeats, device, dtype, compiled))
        except Exception as error:  # a backend that cannot run here (dispatch says why), a kernel that fails to build
            print(f"{case.name}: {type(error).__name__}: {error}", file=sys.stderr)
            failed.append(case.name)
            continue
        compile_time = f" (torch.compile {rows[-1]['compile_s']:.1f} s)" if rows[-1]["compile_s"] is not None else ""
        print(f"  measured {case.name}{compile_time}", flush=True)
    if not rows:
        return 2
    print(format_table(rows))
    if failed:
        print(f"not measured (see above): {', '.join(failed)}")
    for row in rows:
        if row["op"] == "linear_cross_entropy":
            verdict = "met" if row["memory_ratio"] >= CROSS_ENTROPY_MEMORY_TARGET else "NOT met"
            print(f"cross-entropy memory ({row['shape']}): peak {row['reference_peak_mib']:.0f} MiB unfused vs "
                  f"{row['fused_peak_mib']:.0f} MiB {row['path']} = {row['memory_ratio']:.1f}x lower "
                  f"(target >= {CROSS_ENTROPY_MEMORY_TARGET:.0f}x: {verdict}); resident-set growth "
                  f"{row['reference_rss_mib']:.0f} vs {row['fused_rss_mib']:.0f} MiB; loss and gradients "
                  f"max error {row['max_error']:.1e} ({row['check']})"
                  + (f"; compiled CE(h W^T) peak {row['compiled_peak_mib']:.0f} MiB"
                     if row["compiled_peak_mib"] is not None else ""))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    return 1 if failed or any(row["check"] != "ok" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
