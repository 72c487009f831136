"""``xscale bench attention --device cuda``: long-sequence causal attention on one GPU, forward + backward.

    xscale bench attention --device cuda        # T = 4K..64K, bf16, batch 1, 16 heads x 64, window 1024

Rows per length:
  * ``sdpa_flash``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` under
    ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, the baseline;
  * ``local_triton``: causal sliding-window attention, each query block of ``--block`` tokens seeing itself and
    the blocks before it within ``--window`` tokens (128 and 1024: itself and 7 more), through
    ``xscale.ops.block_sparse_attention(..., causal=True, backend="triton")``;
  * ``local_flex``: the same layout through the op's ``backend="flex"`` (FlexAttention with a BlockMask built
    from the layout); "flex: unavailable (why)" where the op has no such backend;
  * ``zoo_local``: what a model with ``attention.kind=local`` runs, the zoo's core (token window ``--window``,
    blocks of ``--block``) through its gathered path (``train.sparse_attention=gather``);
  * ``zoo_bigbird`` and ``zoo_longformer``: the zoo's BigBird (the window, ``--block`` global tokens, 2 random
    blocks per query block) and Longformer (the window and ``--block`` global tokens) cores, gathered;
  * ``zoo_*_flex`` (CUDA only): each zoo core with ``train.sparse_attention=flex``.
Each row: median milliseconds of ``--repeats`` forward + backward steps timed with CUDA events, after two untimed
steps (where Triton and FlexAttention compile); peak CUDA memory of one step (``max_memory_allocated`` after a
reset, so q, k, v and the upstream gradient are included); ratio = flash ms / row ms; the seconds of the two
untimed steps (compilation included). A row whose untimed step takes longer than ``--max-seconds`` is not timed,
nor run at longer lengths. At the first length every local row's output and q/k/v gradients are checked against
the op's PyTorch reference (dense, masked, float32), the zoo rows against SDPA over the pattern's token mask in
float32. The CSV is rewritten after each length.

The same code runs on CPU for the tests: SDPA without forcing a kernel, the local rows through the backend passed.
"""

from __future__ import annotations

import contextlib
import csv
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from xscale import ops
from xscale.bench.kernels import TOLERANCE, max_relative_error, short_reason
from xscale.config.schema import ModelConfig
from xscale.models.attention.core import build_core
from xscale.models.attention.patterns import reference_mask
from xscale.ops.block_sparse_attention import BlockLayout

LENGTHS = (4096, 8192, 16384, 32768, 65536)
TARGET_LENGTH, TARGET_RATIO = 32768, 3.0  # local attention at 32K must be >= 3x faster than flash
FLEX_ZOO_TARGET_RATIO = 5.0  # the zoo's local, BigBird and Longformer cores through FlexAttention at 32K (issue 47)
FIELDS = ["row", "length", "ms", "peak_mib", "vs_flash", "max_error", "warmup_s", "note"]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sliding_window_layout(length: int, block: int, window: int, device: torch.device) -> BlockLayout:
    """Causal local attention: query block i lists key blocks i, i-1, ..., i-window/block+1 (those that exist)."""
    n_blocks, width = -(-length // block), max(1, window // block)
    rows = torch.arange(n_blocks, device=device)
    index = (rows.unsqueeze(1) - torch.arange(width, device=device)).clamp_min(0).to(torch.int32)
    count = (rows + 1).clamp_max(width).to(torch.int32)
    return ops.build_layout(index, count, block, length, length)


ZOO_KINDS = ("local", "bigbird", "longformer")  # the zoo rows, each gathered and (CUDA) through FlexAttention


def zoo_options(kind: str, block: int, window: int) -> dict:
    """The zoo core's options at benchmark scale: the window ``window`` tokens, blocks of ``block``; BigBird and
    Longformer with one block of global tokens, BigBird with 2 random blocks per query block."""
    options = {"window": window, "block_size": block}
    if kind in ("bigbird", "longformer"):
        options["global_tokens"] = block
    if kind == "bigbird":
        options["random_blocks"] = 2
    return options


def zoo_core(kind: str, heads: int, head_dim: int, length: int, block: int, window: int, sparse_attention: str,
             device: torch.device) -> torch.nn.Module:
    """The model zoo's causal ``kind`` core (:func:`zoo_options`) as a model would run it."""
    config = ModelConfig(n_heads=heads, d_model=heads * head_dim, max_seq_len=length)
    core = build_core(kind, config, 0, zoo_options(kind, block, window), True, False).to(device)
    core.sparse_attention = sparse_attention
    return core


def zoo_local_core(heads: int, head_dim: int, length: int, block: int, window: int, sparse_attention: str,
                   device: torch.device) -> torch.nn.Module:
    """The model zoo's causal ``local`` core (|i - j| <= window, blocks of ``block``) as a model would run it."""
    return zoo_core("local", heads, head_dim, length, block, window, sparse_attention, device)


def op_reference(layout: BlockLayout) -> Attention:
    """The op's PyTorch reference over ``layout`` (dense, masked; the check of the local rows)."""
    return lambda q, k, v: ops.block_sparse_attention(q, k, v, layout, causal=True, backend="torch")


def zoo_reference(core: torch.nn.Module) -> Attention:
    """SDPA over the core's dense token mask, in float32 (the quadratic check of the zoo rows)."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        length = q.shape[2]
        mask = reference_mask(core.pattern, length, core.options.block_size, True)[0].to(q.device)
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        return out.to(q.dtype)
    return attend


def make_rows(layout: BlockLayout, device: torch.device, sparse_backend: str,
              zoo: dict[str, torch.nn.Module] | None = None) -> dict[str, Attention]:
    """The attention each row runs; the flash row forces the flash kernel only on CUDA. ``zoo``: row name -> the
    zoo core it runs (:func:`zoo_core`)."""

    def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            context = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        else:
            context = contextlib.nullcontext()
        with context:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def local(backend: str) -> Attention:
        return lambda q, k, v: ops.block_sparse_attention(q, k, v, layout, causal=True, backend=backend)

    rows = {"sdpa_flash": flash, f"local_{sparse_backend}": local(sparse_backend), "local_flex": local("flex")}
    for name, core in (zoo or {}).items():
        rows[name] = lambda q, k, v, core=core: core(q, k, v, causal=True)
    return rows


def _step(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(grad)


def time_ms(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> float:
    """Milliseconds of one forward + backward: CUDA events around it on a GPU, the wall clock on CPU."""
    if q.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(q.device)
        start.record()
        _step(fn, q, k, v, grad)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    _step(fn, q, k, v, grad)
    return (time.perf_counter() - begin) * 1e3


def peak_mib(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> float | None:
    """Peak CUDA memory of one forward + backward (inputs included); None on CPU."""
    if not q.is_cuda:
        return None
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize(q.device)
    torch.cuda.reset_peak_memory_stats(q.device)
    _step(fn, q, k, v, grad)
    torch.cuda.synchronize(q.device)
    return torch.cuda.max_memory_allocated(q.device) / 2**20


def check_error(fn: Attention, reference: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                grad: torch.Tensor) -> float:
    """Max error of output and q/k/v gradients against ``reference``, over the reference's scale."""
    results = []
    for attend in (fn, reference):
        for t in (q, k, v):
            t.grad = None
        out = attend(q, k, v)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in (q, k, v))])
    for t in (q, k, v):
        t.grad = None
    return max_relative_error(results[0], results[1])


def _failure_note(name: str, error: Exception) -> str:
    if name == "local_flex" and isinstance(error, (ValueError, NotImplementedError)):
        return f"flex: unavailable ({short_reason(error)})"
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"failed: {short_reason(error)}"


def run_gpu(lengths: list[int], device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, block: int,
            window: int, repeats: int, max_seconds: float, sparse_backend: str = "triton",
            log: Callable[[str], None] = print, after_length: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every row at every length, in (length, row) order; a row that failed or ran too long stops there."""
    rows: list[dict] = []
    stopped: dict[str, str] = {}  # row -> why it does not run at longer lengths
    for index, length in enumerate(sorted(lengths)):
        generator = torch.Generator(device=device).manual_seed(length)
        q, k, v, grad = (torch.randn(1, heads, length, head_dim, generator=generator, device=device, dtype=dtype)
                         for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        layout = sliding_window_layout(length, block, window, device)
        zoo = {f"zoo_{kind}": zoo_core(kind, heads, head_dim, length, block, window, "gather", device)
               for kind in ZOO_KINDS}
        if device.type == "cuda":
            zoo.update({f"zoo_{kind}_flex": zoo_core(kind, heads, head_dim, length, block, window, "flex", device)
                        for kind in ZOO_KINDS})
        references = {name: zoo_reference(core) for name, core in zoo.items()}
        references[f"local_{sparse_backend}"] = references["local_flex"] = op_reference(layout)
        current, started = [], time.perf_counter()
        for name, fn in make_rows(layout, device, sparse_backend, zoo).items():
            row = {"row": name, "length": length, "ms": None, "peak_mib": None, "vs_flash": None,
                   "max_error": None, "warmup_s": None, "note": stopped.get(name, "")}
            rows.append(row)
            current.append(row)
            if row["note"]:
                continue
            try:
                warmup_start = time.perf_counter()
                untimed = time_ms(fn, q, k, v, grad)  # compiles Triton / flex kernels
                if untimed <= max_seconds * 1e3:
                    untimed = time_ms(fn, q, k, v, grad)
                row["warmup_s"] = time.perf_counter() - warmup_start
                if untimed > max_seconds * 1e3:
                    seconds = untimed / 1e3
                    row["note"] = f"one step {seconds:.1f} s > --max-seconds: not timed"
                    stopped[name] = f"not run: T={length} took {seconds:.1f} s > --max-seconds"
                    continue
                row["ms"] = statistics.median(time_ms(fn, q, k, v, grad) for _ in range(repeats))
                row["peak_mib"] = peak_mib(fn, q, k, v, grad)
                if index == 0 and name.startswith(("local_", "zoo_")):
                    row["max_error"] = check_error(fn, references[name], q, k, v, grad)
                    if row["max_error"] > TOLERANCE[dtype]:
                        row["note"] = f"MISMATCH vs torch reference (> {TOLERANCE[dtype]:g})"
            except Exception as error:  # one row's failure (no flex backend, OOM, a compile error) skips only it
                row["ms"] = row["peak_mib"] = row["max_error"] = None
                row["note"] = _failure_note(name, error)
                stopped[name] = row["note"] if row["note"].startswith("flex:") else f"not run: {row['note']} at T={length}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        flash = current[0]["ms"]
        for row in current:
            if row["ms"] and flash:
                row["vs_flash"] = flash / row["ms"]
            log(format_row(row))
        log(f"T={length:6d} done in {time.perf_counter() - started:.1f} s")
        if after_length is not None:
            after_length(rows)
        del q, k, v, grad, layout, zoo, references
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def target_verdict(row: dict) -> str:
    """The issues' targets at 32K: a local row ">= 3x flash", a zoo core through FlexAttention ">= 5x flash" (local,
    BigBird, Longformer); met or missed."""
    if not row["row"].startswith(("local_", "zoo_")) or row["length"] != TARGET_LENGTH:
        return ""
    target = FLEX_ZOO_TARGET_RATIO if row["row"].startswith("zoo_") and row["row"].endswith("_flex") else TARGET_RATIO
    verdict = "not measured" if row["vs_flash"] is None else ("met" if row["vs_flash"] >= target else "MISSED")
    return f"target >= {target:g}x flash: {verdict}"


def format_row(row: dict) -> str:
    def cell(value: float | None, spec: str, suffix: str = "") -> str:
        return format(value, spec) + suffix if value is not None else "-"

    error = f"max err {row['max_error']:.1e}" if row["max_error"] is not None else ""
    warmup = f"warm-up {row['warmup_s']:.1f} s" if row["warmup_s"] is not None else ""
    notes = "  ".join(part for part in (warmup, error, row["note"], target_verdict(row)) if part)
    return (f"T={row['length']:6d} {row['row']:19s} {cell(row['ms'], '9.2f'):>9s} ms  "
            f"peak {cell(row['peak_mib'], '8.0f'):>8s} MiB  {cell(row['vs_flash'], '6.2f', 'x'):>7s} flash  {notes}")


def main_gpu(lengths: list[int], device: torch.device, heads: int, d_model: int, block: int, window: int,
             repeats: int, max_seconds: float, out_dir: Path) -> int:
    """The GPU mode of ``xscale bench attention``: bf16, batch 1, rows per length as in the module docstring."""
    head_dim = d_model // heads
    print(f"attention bench (GPU): {torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}, "
          f"bf16, batch 1, {heads} heads x {head_dim}, causal; local: block {block}, window {window} tokens; "
          f"median of {repeats} fwd+bwd after 2 untimed; torch {torch.__version__}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    def write_csv(rows: list[dict]) -> None:
        with open(out_dir / "attention_gpu.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    rows = run_gpu(lengths, device, torch.bfloat16, heads, head_dim, block, window, repeats, max_seconds,
                   log=lambda line: print(line, flush=True), after_length=write_csv)
    print(f"wrote {out_dir / 'attention_gpu.csv'}")
    return 1 if any(row["note"].startswith("MISMATCH") for row in rows) else 0
