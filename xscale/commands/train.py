"""``xscale train [CONFIG] [section.key=value ...]``: with no config, the built-in default run."""

from __future__ import annotations

import os
import shlex
import sys

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.checkpoint.checkpointer import CheckpointError, step_dir_name
from xscale.commands.parser import CommandParser
from xscale.config.load import config_to_yaml, load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.data import with_resolved_vocab
from xscale.launcher.env import close_distributed
from xscale.runtime.peer_loss import lost_peer, peer_loss_line
from xscale.train.fault_injection import FaultInjectingTrainer, chaos_files
from xscale.train.run_lock import RunLocked
from xscale.train.trainer import NonFiniteTraining, Trainer

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def resume_command(argv: list[str], resume: str) -> str:
    """The command that continues this run from its latest checkpoint: the same arguments (under torchrun, the
    same torchrun shape), with checkpoint.resume=auto when it named a particular checkpoint."""
    arguments = [argument for argument in argv if not argument.startswith("checkpoint.resume=")]
    if resume != "auto":
        arguments.append("checkpoint.resume=auto")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        launcher = ["torchrun", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"]
        launcher += [f"--nnodes={nodes}", "..."] if nodes > 1 else ["--standalone"]
        return shlex.join([*launcher, "-m", "xscale", "train", *arguments]).replace("'...'", "...")
    return shlex.join(["xscale", "train", *arguments])


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
    argv = list(sys.argv[2:] if argv is None else argv)
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
        files = chaos_files()  # under `xscale chaos`: the soak's in-worker faults and timings
        summary = (FaultInjectingTrainer(config, files) if files else Trainer(config)).fit()
        finished = True
    except (ConfigError, CheckpointError, RunLocked) as error:
        print(f"xscale train: {error}", file=sys.stderr)
        return 2
    except NonFiniteTraining as error:
        print(f"xscale train: training diverged: {error}", file=sys.stderr)
        return 1
    except RuntimeError as error:
        if not lost_peer(error):
            raise
        print(peer_loss_line(error, int(os.environ.get("RANK", "0"))), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the steps began, or a second one: nothing more is saved
        if int(os.environ.get("RANK", "0")) == 0:
            print("xscale train: interrupted; stopped without saving (the checkpoints written so far are kept)",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if ours:
            close_distributed(meet_first=finished)
    if summary["interrupted"]:
        if summary["rank"] == 0:
            saved = f"{summary['checkpoint']}/{step_dir_name(summary['step'])}"
            print(f"interrupted at step {summary['step']}; checkpoint saved to {saved}; resume with: "
                  f"{resume_command(argv, config.checkpoint.resume)}", flush=True)
        return EXIT_INTERRUPTED
    if summary["rank"] != 0:
        return 0
    if summary["preempted"]:
        print(f"preempted at step {summary['step']}: checkpoint written to {summary['checkpoint']}; the job resumes "
              f"from it when started again")
    elif summary["losses"]:
        saved = (f"checkpoints in {summary['checkpoint']}" if config.checkpoint.every >= 0
                 else "no checkpoint (checkpoint.every=-1)")
        print(f"done: step {summary['step']}, last loss {summary['losses'][-1]:.4f}, {saved}"
              + (f", plot {summary['plot']}" if summary["plot"] else ""))
    return 0
