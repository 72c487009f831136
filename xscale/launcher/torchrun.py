"""torchrun with xscale's exit codes and short messages: ``python -m xscale.launcher.torchrun [torchrun options]
-m xscale train ...`` (what ``launch/torchrun.sh`` runs).

Plain torchrun ends with exit 1 and its ``ChildFailedError`` report whatever its workers exited with, and turns a
Ctrl-C into a ``SignalException`` traceback (after forwarding SIGINT to the workers, which save and exit 130). This
runs torchrun's own launch (``torch.distributed.run.run``) and maps the outcome: exit 3 when a worker's watchdog
ended a hung job (:data:`~xscale.train.watchdog.EXIT_HUNG`), 130 after Ctrl-C, otherwise the first failed worker's
code (128 + N for a signal N), each with at most one line of its own.

``--warm MODULE[,MODULE...]`` (xscale's option, before torchrun's): the workers are forked from a server process
that imported the MODULEs once (``multiprocessing``'s forkserver with those modules preloaded), instead of each
starting a fresh interpreter. A restart after a failed worker (``--max-restarts``) then skips the imports, the most
of what a restart costs on a CPU machine (``import torch`` and xscale's training stack, ~5-13 s a worker on 2
shared cores; docs/reliability.md). The job runs as ``python -m MODULE`` would: its ``__main__`` file through
torchrun's ``--run-path``. The server is started from this agent with its environment (torchrun's
``OMP_NUM_THREADS`` included); each worker gets its own variables after the fork, so the preloaded modules must not
read a worker's variables (RANK, LOCAL_RANK, ...) at import time (xscale's do not).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

EXIT_HUNG = 3  # xscale.train.watchdog.EXIT_HUNG (train sits above the launcher layer)
EXIT_INTERRUPTED = 130


def job_exit_code(failures: dict[int, int]) -> int:
    """The job's exit code from its failed workers' (rank -> exit code; negative: killed by that signal)."""
    codes = [failures[rank] for rank in sorted(failures)]
    for meaningful in (EXIT_HUNG, EXIT_INTERRUPTED):
        if meaningful in codes:
            return meaningful
    first = codes[0] if codes else 1
    return 128 - first if first < 0 else first or 1


WARM_OPTION = "--warm"


class WarmStartError(ValueError):
    """``--warm`` cannot be used with this command line."""


def split_warm_option(argv: list[str]) -> tuple[list[str] | None, list[str]]:
    """(the modules ``--warm`` names, or None; the rest for torchrun). Only before torchrun's training script: what
    follows the script is the script's."""
    for index, word in enumerate(argv):
        if word in ("-m", "--module") or not word.startswith("-"):
            break
        if word == WARM_OPTION or word.startswith(WARM_OPTION + "="):
            value = word.partition("=")[2] if "=" in word else (argv[index + 1] if index + 1 < len(argv) else "")
            modules = [module for module in value.split(",") if module]
            if not modules:
                raise WarmStartError(f"{WARM_OPTION} needs the modules to import once, e.g. {WARM_OPTION} "
                                     "torch,xscale.commands.train")
            rest = argv[:index] + argv[index + (1 if "=" in word else 2):]
            return modules, rest
    return None, argv


def _find_spec(module: str):
    """``importlib.util.find_spec``, None where the module or a package above it does not exist."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def main_file(module: str) -> str:
    """The file ``python -m module`` runs: a package's ``__main__.py`` or the module's own file."""
    spec = _find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = _find_spec(f"{module}.__main__")
    if spec is None or not spec.origin or not spec.has_location:
        raise WarmStartError(f"{WARM_OPTION}: cannot find the file of module {module!r} to run; check the name")
    return spec.origin


def warm_start(args, modules: list[str]) -> None:
    """Run the workers forked from a server that imported ``modules`` (the module docstring)."""
    if args.no_python:
        raise WarmStartError(f"{WARM_OPTION} runs Python workers; drop --no-python")
    missing = [module for module in modules if _find_spec(module) is None]
    if missing:  # the server would skip them silently and every restart would pay their imports
        raise WarmStartError(f"{WARM_OPTION}: no module named {', '.join(missing)}; check the names")
    if args.module:
        args.training_script, args.module = main_file(args.training_script), False
    args.run_path, args.start_method = True, "forkserver"
    multiprocessing.set_forkserver_preload(modules)


def main(argv: list[str] | None = None) -> int:
    try:
        warm, rest = split_warm_option(sys.argv[1:] if argv is None else argv)
        args = parse_args(rest)
        if warm:
            warm_start(args, warm)
    except WarmStartError as error:
        print(f"xscale torchrun: {error}", file=sys.stderr, flush=True)
        return 2
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # its per-worker shutdown warnings
    try:
        run(args)
    except ChildFailedError as error:
        codes = {rank: failure.exitcode for rank, failure in error.failures.items()}
        code = job_exit_code(codes)
        reason = {EXIT_HUNG: "a hung rank was ended by the watchdog (its report is above)",
                  EXIT_INTERRUPTED: "interrupted"}.get(code, "a worker failed (its error is above)")
        print(f"xscale torchrun: {reason}; worker exit codes {codes}; exit {code}", file=sys.stderr, flush=True)
        return code
    except SignalException as error:
        return EXIT_INTERRUPTED if error.sigval == signal.SIGINT else 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
