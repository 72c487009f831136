"""Start local worker processes fast: fork them from a server that imported torch and xscale once.

A fresh interpreter per rank (``spawn``) re-imports torch and xscale, about 3 s per process on two cores; every
parity run and multi-process test paid it. ``forkserver`` forks each worker from a single-threaded server that
preloaded those modules (about 20 ms), and every worker is still a new process: nothing of one run (process groups,
DTensor meshes, RNG state, module globals) reaches the next, unlike a pool of long-lived workers.

A forked worker inherits the server's environment, not the caller's current one, so :func:`start_local` hands the
caller's ``os.environ`` to every worker, which installs it before the function runs. Variables that torch reads
only at import time (e.g. ``OMP_NUM_THREADS``) come from the environment the server started in.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "xscale.train.trainer")


def _with_environment(index: int, environment: dict[str, str], function: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    function(index, *args)


def local_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose workers fork from the preloaded server (started on first use)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs: it preloaded these already
    return context


def start_local(function: Callable[..., Any], nprocs: int, args: tuple = ()) -> None:
    """``function(index, *args)`` in ``nprocs`` new local processes with the caller's environment; joins them and
    raises ``torch.multiprocessing.ProcessRaisedException`` (with the worker's traceback) when one fails."""
    local_context()
    mp.start_processes(_with_environment, args=(dict(os.environ), function, args), nprocs=nprocs, join=True,
                       start_method="forkserver")
