"""``xscale convert``: outside weights into an xscale checkpoint (step 0, weights only).

  xscale convert hf-to-xscale HF_DIR OUT_CHECKPOINT_DIR [model.key=value ...]
  xscale convert safetensors-to-xscale EXPORT.safetensors OUT_CHECKPOINT_DIR

The result is a normal checkpoint directory: train from it with ``checkpoint.resume=OUT_CHECKPOINT_DIR/step_00000000``
(the run's model settings must match it), or write it out again with ``xscale export``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.parser import CommandParser
from xscale.config.load import parse_override, set_path
from xscale.config.schema import ConfigError
from xscale.interop.checkpoint import hf_tokenizer_files, write_weights_checkpoint
from xscale.interop.exported import exported_model_config, exported_state_dict
from xscale.interop.hf.load import fill_from_hf, hf_model_config
from xscale.interop.hf.rules import InteropError


def _model_overrides(texts: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for text in texts:
        keys, value = parse_override(text)
        if keys[0] != "model" or len(keys) < 2:
            raise ConfigError(f"override '{text}': only model.* settings apply to a conversion")
        set_path(tree, keys[1:], value)
    return tree


def hf_to_xscale(args: argparse.Namespace) -> str:
    model = hf_model_config(args.source, _model_overrides(args.overrides))
    step_dir = write_weights_checkpoint(model, lambda state: fill_from_hf(state, args.source, model), args.output,
                                        source=f"hf:{args.source}", tokenizer_from=args.source)
    copied = [Path(name).name for name in hf_tokenizer_files(args.source)]
    return f"wrote {step_dir}" + (f" (tokenizer: {', '.join(copied)})" if copied else
                                  f" (no tokenizer in {args.source}: give xscale generate --tokenizer)")


def safetensors_to_xscale(args: argparse.Namespace) -> str:
    model = exported_model_config(args.source)
    exported = exported_state_dict(args.source, model)

    def fill(state: dict) -> None:
        if set(state) != set(exported):
            raise InteropError(f"{args.source} does not hold this model's tensors (differing: "
                               f"{', '.join(sorted(set(state) ^ set(exported))[:5])})")
        for name, tensor in state.items():
            tensor.copy_(exported[name])

    return f"wrote {write_weights_checkpoint(model, fill, args.output, source=str(args.source))}"


TOOLS = {"hf-to-xscale": (hf_to_xscale, "a Hugging Face model folder (GPT-2, Llama, BERT, T5)"),
         "safetensors-to-xscale": (safetensors_to_xscale, "a file written by xscale export (--format xscale)")}


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for name, (_, help_text) in TOOLS.items():
        tool = sub.add_parser(name, help=help_text)
        tool.add_argument("source", help=help_text)
        tool.add_argument("output", help="the checkpoint directory to write (step_00000000 inside)")
        if name == "hf-to-xscale":
            tool.add_argument("overrides", nargs="*", help="model.key=value settings laid over config.json")
    args = parser.parse_args(argv)
    try:
        print(TOOLS[args.tool][0](args))
    except (InteropError, ConfigError, CheckpointError, OSError) as error:
        print(f"xscale convert {args.tool}: {error}", file=sys.stderr)
        return 2
    return 0
