"""A shorter OpenMP spin-wait for the ``xscale`` command on CPU: idle worker threads yield their core sooner.

GNU OpenMP (libgomp, which torch's Linux wheels use) keeps a team's threads spinning after each parallel region for
``GOMP_SPINCOUNT`` iterations, 300,000 by default, before they sleep. An iteration is a PAUSE instruction, which
takes up to ~140 cycles on recent Intel server cores, so an idle thread can hold its core for milliseconds after
every multi-threaded op. Work on threads of our own then shares the core with it: the MoE layer's experts run side
by side on worker threads (:mod:`xscale.ops.expert_threads`). On a 2-core AVX-512 machine the MoE layer's step ran
1.24-1.26x the dense FFN's with libgomp's default and 1.17-1.19x with 10,000 iterations (``xscale bench moe --ep 1``,
alternating runs; docs/benchmarks.md, 2026-11-28), and GPT-2-shaped training steps (xscale's and Hugging Face's)
were as fast or faster with it.

libgomp reads the variable once, when torch loads it, so :func:`limit_openmp_spin` runs before ``import torch``
(the ``xscale`` command's entry, inherited by the processes it starts). A user's own ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` wins; ``XSCALE_OPENMP_SPIN=default`` keeps libgomp's default (``short``, xscale's, is the
same as leaving it unset; any other value is an error, not silently ignored).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "10000"
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
CHOICES = ("short", "default")


def limit_openmp_spin(environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to 10,000 in ``environ`` (the process's) unless the user chose a wait policy or torch
    is already loaded (then it could no longer take effect). Returns whether this call set it."""
    environ = os.environ if environ is None else environ
    choice = environ.get("XSCALE_OPENMP_SPIN", "short")
    if choice not in CHOICES:
        raise ValueError(f"XSCALE_OPENMP_SPIN={choice!r} is not one of {', '.join(CHOICES)}: 'short' (xscale's "
                         f"{SPIN_COUNT}-iteration OpenMP spin-wait) or 'default' (libgomp's own); or unset it")
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if torch_loaded or choice == "default" or any(name in environ for name in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
