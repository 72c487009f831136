"""``xscale export CHECKPOINT --output model.safetensors``: the weights of a (sharded) checkpoint in one file.

Works without a process group: DCP reads every shard and assembles full tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

from xscale.command_line import CommandParser
from xscale.models import build_model
from xscale.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    check_fingerprint,
    load_state,
    shape_fingerprint,
)
from xscale.validate import config_from_dict


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or a checkpoint root whose ``latest`` names one."""
    if (path / "latest").is_file():
        latest = Checkpointer(path).latest()
        assert latest is not None
        return latest
    return path


def export_safetensors(checkpoint: str | Path, output: str | Path) -> Path:
    from safetensors.torch import save_file

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
                                               "xscale_family": config.model.family})
    return output


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step directory or a checkpoint root (uses its 'latest')")
    parser.add_argument("output", nargs="?", help="path of the .safetensors file to write")
    parser.add_argument("--output", "-o", dest="output_option", metavar="OUTPUT", help="the same, as an option")
    args = parser.parse_args(argv)
    if (args.output is None) == (args.output_option is None):
        parser.error("give the output path once: xscale export CHECKPOINT OUTPUT (or -o OUTPUT)")
    args.output = args.output or args.output_option
    try:
        path = export_safetensors(args.checkpoint, args.output)
    except CheckpointError as error:
        print(f"xscale export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
