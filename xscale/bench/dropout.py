"""``xscale bench dropout``: the layout-independent :class:`~xscale.models.dropout.Dropout` against
``nn.Dropout`` in the same run, as time ratios: alone on a (B, T, D) activation, and inside a Transformer block
(its residual and FFN dropouts swapped for ``nn.Dropout``), forward + backward. Attention dropout is left out:
there the cost is that of forming the probabilities instead of SDPA's fused kernel."""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from xscale.commands.parser import CommandParser
from xscale.config.schema import ModelConfig
from xscale.models.block import TransformerBlock
from xscale.models.dropout import Dropout
from xscale.runtime import StepContext


class TorchDropout(nn.Dropout):
    """``nn.Dropout`` taking (and ignoring) the step context that xscale's modules pass their dropouts."""

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        return super().forward(x)


def seconds_per_call(module: nn.Module, x: torch.Tensor, repeats: int,
                     context: StepContext | None = None) -> float:
    def run() -> None:
        module(x, context=context).sum().backward()

    run()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def with_torch_dropout(module: nn.Module) -> nn.Module:
    """``module`` with every :class:`Dropout` replaced by an ``nn.Dropout`` of the same probability."""
    for name, child in module.named_children():
        if isinstance(child, Dropout):
            setattr(module, name, TorchDropout(child.p))
        else:
            with_torch_dropout(child)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(prog="xscale bench dropout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 512, 1024], metavar=("B", "T", "D"))
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    x = torch.randn(*args.shape, device=args.device, dtype=getattr(torch, args.dtype), requires_grad=True)
    reference = TorchDropout(args.p).train()
    ours = Dropout(args.p).train()
    context = StepContext(seed=0, step=0)
    for _ in range(2):  # interleaved rounds: load on a shared machine hits both alike
        base = seconds_per_call(reference, x, args.repeats, context)
        mine = seconds_per_call(ours, x, args.repeats, context)
        print(f"dropout alone, {tuple(args.shape)} {args.dtype} on {args.device}: nn.Dropout {base * 1e3:.2f} ms, "
              f"layout-independent {mine * 1e3:.2f} ms, ratio {mine / base:.2f}")
    config = ModelConfig(d_model=args.shape[2], n_heads=max(1, args.shape[2] // 64), dropout=args.p)
    block = TransformerBlock(config, 0, causal=True).to(args.device, x.dtype).train()
    for _ in range(2):
        mine = seconds_per_call(block, x, args.block_repeats, context)
        base = seconds_per_call(with_torch_dropout(copy.deepcopy(block)), x, args.block_repeats, context)
        print(f"Transformer block (d_model {args.shape[2]}, dropout {args.p}): nn.Dropout {base * 1e3:.2f} ms, "
              f"layout-independent {mine * 1e3:.2f} ms, ratio {mine / base:.2f}")


if __name__ == "__main__":
    main()
