"""torchrun with xscale's exit codes and short messages: ``python -m xscale.launcher.torchrun [torchrun options]
-m xscale train ...`` (what ``launch/torchrun.sh`` runs).

Plain torchrun ends with exit 1 and its ``ChildFailedError`` report whatever its workers exited with, and turns a
Ctrl-C into a ``SignalException`` traceback (after forwarding SIGINT to the workers, which save and exit 130). This
runs torchrun's own launch (``torch.distributed.run.run``) and maps the outcome: exit 3 when a worker's watchdog
ended a hung job (:data:`~xscale.train.watchdog.EXIT_HUNG`), 130 after Ctrl-C, otherwise the first failed worker's
code (128 + N for a signal N), each with at most one line of its own.
"""

from __future__ import annotations

import logging
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
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
