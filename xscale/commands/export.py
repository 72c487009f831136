"""``xscale export CHECKPOINT OUTPUT [--format xscale|hf]``: a checkpoint's weights outside DCP.

``--format xscale`` (the default): one safetensors file under xscale's names, tied weights stored once, the model
config in its metadata; :func:`xscale.interop.load_exported` loads it back. ``--format hf``: a Hugging Face model
folder (:mod:`xscale.interop.hf.save`). Works without a process group: DCP reads every shard into full tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    check_fingerprint,
    load_state,
    shape_fingerprint,
)
from xscale.commands.parser import CommandParser
from xscale.config.load import config_from_dict
from xscale.config.schema import ConfigError
from xscale.interop.exported import MODEL_METADATA
from xscale.interop.hf.rules import InteropError
from xscale.interop.hf.save import DEFAULT_SHARD_BYTES, export_hf
from xscale.models import build_model


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, a checkpoint root whose ``latest`` names one, or a run's output directory (its
    ``checkpoints/latest``)."""
    if not (path / "latest").is_file() and (path / "checkpoints" / "latest").is_file():
        path = path / "checkpoints"
    if (path / "latest").is_file():
        latest = Checkpointer(path).latest()
        assert latest is not None
        return latest
    return path


def export_safetensors(checkpoint: str | Path, output: str | Path) -> Path:
    step_dir = resolve_checkpoint(Path(checkpoint))
    meta = Checkpointer.read_meta(step_dir, verify="full")
    config = config_from_dict(meta["config"])
    model = build_model(config.model, "cpu", seed=config.train.seed)
    state = model.state_dict()
    check_fingerprint(meta.get("fingerprint", {}), shape_fingerprint(state), step_dir)
    load_state({"model": state}, step_dir)
    model.load_state_dict(state)
    tensors, seen = {}, set()
    for name, param in model.state_dict().items():
        if id(param) in seen or param.untyped_storage().data_ptr() in seen:
            continue  # tied weights are stored once (under the embedding's name)
        seen.update({id(param), param.untyped_storage().data_ptr()})
        tensors[name] = param.detach().contiguous()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output), metadata={"xscale_step": str(meta["step"]),
                                               "xscale_family": config.model.family,
                                               MODEL_METADATA: json.dumps(dataclasses.asdict(config.model))})
    return output


def _size(text: str) -> int:
    """'5GB', '200MB', '1024' -> bytes (powers of 1000, as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 5GB, 200MB or a number of bytes")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step directory, a checkpoint root or a run directory (uses its 'latest')")
    parser.add_argument("output", nargs="?", help="the .safetensors file (xscale) or the folder (hf) to write")
    parser.add_argument("--output", "-o", dest="output_option", metavar="OUTPUT", help="the same, as an option")
    parser.add_argument("--format", choices=("xscale", "hf"), default="xscale",
                        help="xscale: one file, xscale's names (default); hf: a Hugging Face model folder")
    parser.add_argument("--max-shard-size", type=_size, default=DEFAULT_SHARD_BYTES,
                        help="--format hf: the largest safetensors shard (default 5GB)")
    args = parser.parse_args(argv)
    if (args.output is None) == (args.output_option is None):
        parser.error("give the output path once: xscale export CHECKPOINT OUTPUT (or -o OUTPUT)")
    args.output = args.output or args.output_option
    try:
        if args.format == "hf":
            path = export_hf(resolve_checkpoint(Path(args.checkpoint)), args.output, args.max_shard_size)
        else:
            path = export_safetensors(args.checkpoint, args.output)
    except (CheckpointError, InteropError, ConfigError) as error:
        print(f"xscale export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
