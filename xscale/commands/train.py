"""``xscale train [CONFIG] [section.key=value ...]``: with no config, the built-in default run."""

from __future__ import annotations

import sys

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.parser import CommandParser
from xscale.config.load import config_to_yaml, load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.data import with_resolved_vocab
from xscale.launcher.env import close_distributed
from xscale.train.run_lock import RunLocked
from xscale.train.trainer import NonFiniteTraining, Trainer


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="xscale train",
        description="Train a model. With no CONFIG, a small decoder on the built-in corpus (no download, CPU ok).",
    )
    parser.add_argument("config", nargs="?", help="YAML config (configs/*.yaml); omit for the built-in default")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 model.norm=layernorm")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved, validated config as YAML (a file xscale train reads back) and exit "
                             "without building anything")
    args = parser.parse_intermixed_args(argv)
    try:
        config = load_config_from_cli(args.config, args.overrides)
    except ConfigError as error:
        print(f"xscale train: invalid configuration: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        try:
            print(config_to_yaml(with_resolved_vocab(config)), end="")
        except ConfigError as error:
            print(f"xscale train: invalid configuration: {error}", file=sys.stderr)
            return 2
        return 0
    import torch.distributed as dist

    ours, finished = not dist.is_initialized(), False  # a group the caller set up stays theirs
    try:
        summary = Trainer(config).fit()
        finished = True
    except (ConfigError, CheckpointError, RunLocked) as error:
        print(f"xscale train: {error}", file=sys.stderr)
        return 2
    except NonFiniteTraining as error:
        print(f"xscale train: training diverged: {error}", file=sys.stderr)
        return 1
    finally:
        if ours:
            close_distributed(meet_first=finished)
    if summary["rank"] != 0:
        return 0
    if summary["preempted"]:
        print(f"preempted at step {summary['step']}: checkpoint written to {summary['checkpoint']}; the job resumes "
              f"from it when started again")
    elif summary["losses"]:
        print(f"done: step {summary['step']}, last loss {summary['losses'][-1]:.4f}, "
              f"checkpoints in {summary['checkpoint']}" + (f", plot {summary['plot']}" if summary["plot"] else ""))
    return 0
