"""``xscale bench train``: xscale vs Hugging Face GPT2LMHeadModel, same shape, same machine, one run.

Both models train (forward + backward + AdamW step) on the same random tokens in fp32; the
benchmark alternates between them so that machine noise hits both, and prints tokens/s, the
ratio xscale / HF, and each one's MFU against this device's measured matmul peak.
"""

from __future__ import annotations

import statistics
import time

import torch

from xscale.command_line import CommandParser
from xscale.interop.hf.load import model_config_from_hf, state_dict_from_hf
from xscale.models import build_model
from xscale.parallel.model import ParallelModel
from xscale.train.metrics import flops_per_token, measure_matmul_peak
from xscale.train.step import forward_backward_step


def _hf_step(model, optimizer, tokens: torch.Tensor) -> None:
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _xscale_step(model: ParallelModel, optimizer, tokens: torch.Tensor) -> None:
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    forward_backward_step(model, {"input_ids": tokens, "labels": labels})
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        print("xscale bench train needs transformers (pip install -e .[dev])")
        return 2

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0)
    hf_config._attn_implementation = "sdpa"
    hf = transformers.GPT2LMHeadModel(hf_config).train()
    config = model_config_from_hf(hf_config.to_dict())
    ours = build_model(config, "cpu")
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config, "gpt2"))
    ours.train()
    parallel = ParallelModel([ours], micro_batch_size=args.batch)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    our_optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    tokens_per_step = args.batch * args.seq

    runs = {"huggingface": lambda: _hf_step(hf, hf_optimizer, tokens),
            "xscale": lambda: _xscale_step(parallel, our_optimizer, tokens)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in runs.values():  # warm-up
        step()
    for _ in range(args.steps):
        for name, step in runs.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)

    peak = measure_matmul_peak(torch.float32)
    num_params = sum(p.numel() for p in ours.parameters()) - args.vocab * args.width
    flops = flops_per_token(config, args.seq, num_params)
    print(f"GPT-2-shaped: {args.layers} layers, width {args.width}, {args.heads} heads, vocab {args.vocab}, "
          f"batch {args.batch}x{args.seq}, fp32, {torch.get_num_threads()} threads")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    rates = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rates[name] = tokens_per_step / median
        print(f"{name:12s} {rates[name]:10.1f} tokens/s  (median step {median:.3f} s over {len(samples)})  "
              f"MFU {rates[name] * flops / peak:.1%}")
    print(f"ratio xscale / huggingface: {rates['xscale'] / rates['huggingface']:.3f}x")
    return 0
