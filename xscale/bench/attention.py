"""Efficient-attention benchmark: forward + backward time and saved-activation memory of every core against
naive softmax attention (T x T materialised) and torch SDPA, measured in the same process.

    python -m xscale.bench.attention --lengths 1024,2048,4096 --variants local,linear,performer --out out/attn

Memory is the bytes of tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
unique storages, inputs q/k/v excluded) plus the output: what a training step must hold per attention layer.
It does not see transient buffers freed inside the forward pass. Time is the best of ``--repeats`` runs after
one warm-up (which also builds cached sparsity plans). Width 512, 8 heads (hd 64), batch 1; causal wherever the
variant allows, else bidirectional against bidirectional baselines (marked in the table).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from xscale.config import ModelConfig
from xscale.models.attention.core import build_core

# Options at benchmark scale (the zoo's defaults are sized for tiny tests).
VARIANTS: dict[str, dict] = {
    "local": {"window": 256, "block_size": 128},
    "block_local": {"chunk": 256, "neighbours": 1, "block_size": 128},
    "dilated": {"window": 128, "dilation": 2, "block_size": 128},
    "strided": {"stride": 128, "block_size": 64},
    "fixed": {"stride": 128, "summary": 16, "block_size": 64},
    "longformer": {"window": 256, "global_tokens": 64, "block_size": 128},
    "bigbird": {"window": 64, "global_tokens": 128, "random_blocks": 3, "block_size": 64},
    "lsh": {"buckets": 32, "rounds": 2, "chunk": 64},
    "linear": {"chunk": 64},
    "performer": {"features": 256, "chunk": 64},
    "rfa": {"features": 128, "chunk": 64},
    "linformer": {"projected_length": 256},
    "nystrom": {"landmarks": 64},
}
BASELINES = ("naive", "sdpa")
QUICK_VARIANTS = ("local", "bigbird", "linear", "performer", "lsh", "linformer", "nystrom")


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V with the T x T matrix materialised."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def measure(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int) -> tuple[float, int]:
    """(best forward+backward seconds, saved-for-backward + output bytes)."""
    excluded = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    grad = None
    best = math.inf
    for attempt in range(repeats + 1):
        for t in (q, k, v):
            t.grad = None
        storages.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(q, k, v)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        elapsed = time.perf_counter() - start
        if attempt > 0:
            best = min(best, elapsed)
        memory = sum(storages.values()) + out.numel() * out.element_size()
        del out
    return best, memory


def make_runner(name: str, length: int, causal: bool, heads: int, d_model: int):
    if name == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    config = ModelConfig(d_model=d_model, n_heads=heads, max_seq_len=length)
    core = build_core(name, config, 0, VARIANTS[name], causal, False)
    return lambda q, k, v: core(q, k, v, causal=causal)


def causal_for(name: str) -> bool:
    from xscale.models.registry import ATTENTION

    return True if name in BASELINES else ATTENTION.get(name).causal_capable


def crossover(rows: list[dict], name: str, causal: bool) -> str:
    """Smallest measured length from which the variant stays faster than SDPA (same masking)."""
    mine = {r["length"]: r for r in rows if r["variant"] == name and r["causal"] == causal and r["seconds"]}
    sdpa = {r["length"]: r for r in rows if r["variant"] == "sdpa" and r["causal"] == causal and r["seconds"]}
    lengths = sorted(set(mine) & set(sdpa))
    faster = [n for n in lengths if mine[n]["seconds"] < sdpa[n]["seconds"]]
    if not faster:
        return f"> {max(lengths)}" if lengths else "n/a"
    first = next((n for n in lengths if all(m in faster for m in lengths if m >= n)), None)
    if first is None:
        return f"> {max(lengths)} (faster only at {', '.join(map(str, faster))})"
    return f"<= {first}" if first == lengths[0] else str(first)


def write_outputs(rows: list[dict], out_dir: Path, names: list[str]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["variant", "causal", "length", "seconds", "saved_mib", "vs_naive", "vs_sdpa", "note"]
    with open(out_dir / "attention.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| variant | causal | T | fwd+bwd s | saved MiB | speed-up vs naive | vs SDPA | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def fmt(x, spec):
            return format(x, spec) if isinstance(x, float) else "-"

        lines.append(f"| {r['variant']} | {'yes' if r['causal'] else 'no'} | {r['length']} | {fmt(r['seconds'], '.3f')} "
                     f"| {fmt(r['saved_mib'], '.1f')} | {fmt(r['vs_naive'], '.2f')}x | {fmt(r['vs_sdpa'], '.2f')}x "
                     f"| {r['note']} |")
    lines += ["", "| variant | crossover vs SDPA (time) |", "|---|---|"]
    for name in names:
        if name not in BASELINES:
            lines.append(f"| {name} | {crossover(rows, name, causal_for(name))} |")
    table = "\n".join(lines)
    (out_dir / "attention.md").write_text(table + "\n")
    _plot(rows, out_dir / "attention.png")
    return table


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 5))
    for key in sorted({(r["variant"], r["causal"]) for r in rows}):
        points = [r for r in rows if (r["variant"], r["causal"]) == key and r["seconds"]]
        if not points:
            continue
        label = f"{key[0]}{'' if key[1] else ' (bidir)'}"
        style = "--" if key[0] in BASELINES else "-"
        lengths = [r["length"] for r in points]
        ax_time.plot(lengths, [r["seconds"] for r in points], style, marker="o", label=label)
        ax_mem.plot(lengths, [r["saved_mib"] for r in points], style, marker="o", label=label)
    for ax, title in ((ax_time, "forward+backward seconds"), (ax_mem, "saved activations MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="T=1K,2K and a few main variants")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--naive-max-length", type=int, default=8192, help="skip naive above (T x T memory)")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="skip longer lengths after a slower case")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--out", default="bench_out/attention")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [x for x in args.variants.split(",") if x]
    if args.quick:
        lengths = [n for n in lengths if n <= 2048] or [1024, 2048]
        variants = [v for v in variants if v in QUICK_VARIANTS]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    head_dim = args.d_model // args.heads
    modes = sorted({causal_for(v) for v in variants}, reverse=True)
    names = [b for b in BASELINES] + variants
    print(f"attention bench: d_model {args.d_model}, {args.heads} heads, lengths {lengths}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    rows: list[dict] = []
    too_slow: set[tuple[str, bool]] = set()
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, args.heads, length, head_dim, generator=generator).requires_grad_() for _ in range(3))
        reference: dict[tuple[str, bool], float] = {}
        for name in names:
            for causal in modes if name in BASELINES else [causal_for(name)]:
                row = {"variant": name, "causal": causal, "length": length, "seconds": None, "saved_mib": None,
                       "vs_naive": None, "vs_sdpa": None, "note": ""}
                if (name, causal) in too_slow:
                    row["note"] = f"skipped: a shorter length took > {args.max_seconds:.0f} s"
                elif name == "naive" and length > args.naive_max_length:
                    row["note"] = f"skipped: T x T above --naive-max-length {args.naive_max_length}"
                else:
                    seconds, memory = measure(make_runner(name, length, causal, args.heads, args.d_model), q, k, v,
                                              args.repeats)
                    row["seconds"], row["saved_mib"] = seconds, memory / 2**20
                    reference[(name, causal)] = seconds
                    if seconds > args.max_seconds:
                        too_slow.add((name, causal))
                    if ("naive", causal) in reference:
                        row["vs_naive"] = reference[("naive", causal)] / seconds
                    if ("sdpa", causal) in reference:
                        row["vs_sdpa"] = reference[("sdpa", causal)] / seconds
                rows.append(row)
                shown = f"{row['seconds']:.3f} s, {row['saved_mib']:.1f} MiB" if row["seconds"] else row["note"]
                ratios = "".join(f", {row[key]:.2f}x {key[3:]}" for key in ("vs_naive", "vs_sdpa") if row[key])
                print(f"T={length:6d} {name:12s} {'causal' if causal else 'bidir ':6s} {shown}{ratios}", flush=True)
    table = write_outputs(rows, Path(args.out), names)
    print(table)
    print(f"wrote {args.out}/attention.md, attention.csv, attention.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
