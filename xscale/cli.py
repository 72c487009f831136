"""The ``xscale`` command: train | eval | generate | inspect | plan | export | convert | bench | data | submit | parity |
chaos."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import xscale
from xscale.commands.parser import print_command_help
from xscale.launcher.openmp_spin import limit_openmp_spin

# command -> (module, function, one-line help); modules load lazily so `xscale --help` is instant.
COMMANDS = {
    "train": ("xscale.commands.train", "main", "train a model: xscale train [CONFIG] [section.key=value ...]"),
    "eval": ("xscale.commands.eval", "main", "loss and perplexity of a checkpoint on its run's data or other data"),
    "generate": ("xscale.commands.generate", "main", "continue a prompt with a trained decoder (KV cache, sampling)"),
    "inspect": ("xscale.commands.inspect", "main", "parameters, FLOPs per token and per-rank memory of a config"),
    "plan": ("xscale.commands.plan", "main", "the fastest layouts that fit N devices of a cluster, predicted"),
    "export": ("xscale.commands.export", "main", "write a checkpoint's weights: one safetensors file, or --format hf"),
    "convert": ("xscale.commands.convert", "main", "Hugging Face weights (or an export) into an xscale checkpoint"),
    "bench": ("xscale.commands.bench", "main", "benchmarks: train | attention | kernels | moe | parallel | collectives | "
              "optimizer | dropout | memory | plan | published | fp8 | lra"),
    "data": ("xscale.commands.data", "main", "data tools: tokenizer | preprocess"),
    "submit": ("xscale.commands.submit", "main", "render and submit a Slurm job"),
    "parity": ("xscale.commands.parity", "main", "compare loss curves across parallel layouts"),
    "chaos": ("xscale.commands.chaos", "main", "a training job with seeded faults injected: lost time, goodput, parity"),
}


def version() -> str:
    """The installed package's version; this source tree's when it is not installed."""
    try:
        return importlib.metadata.version("xscale")
    except importlib.metadata.PackageNotFoundError:
        return xscale.__version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"xscale {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print_command_help("xscale", "Distributed training of Transformer variants. xscale COMMAND --help "
                           "describes each command.", "commands",
                           {name: help_text for name, (_, _, help_text) in COMMANDS.items()}, version=True)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"xscale: unknown command '{command}'{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[command]
    try:
        limit_openmp_spin()  # before the command imports torch (xscale/launcher/openmp_spin.py)
    except ValueError as error:
        print(f"xscale: {error}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith(module_name.rsplit(".", 1)[0]):
            print(f"xscale {command}: not available in this build ({error.name} missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(module, function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
