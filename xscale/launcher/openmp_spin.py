"""A shorter OpenMP spin-wait for the ``xscale`` command on CPU: idle worker threads yield their core sooner.

GNU OpenMP (libgomp, which torch's Linux wheels use) keeps a team's threads spinning after each parallel region for
``GOMP_SPINCOUNT`` iterations, 300,000 by default, before they sleep. An iteration is a PAUSE instruction, about 140
cycles on Intel cores since Skylake-SP, so an idle thread holds its core for up to ~14 ms after every multi-threaded
op. Work on threads of our own then shares the core with it: the MoE layer's experts run side by side on worker
threads (:mod:`xscale.ops.expert_threads`), and on a 2-core AVX-512 machine they ran 1.08-1.14x the dense FFN's
time right after a multi-threaded op against 1.01-1.04x with a spin count of 10,000 (~0.5 ms), and the whole MoE
layer 1.21-1.28x against 1.12-1.17x (``xscale bench moe``, README "Benchmarks"). GPT-2-shaped training steps (xscale
and Hugging Face's) were as fast or faster with it (docs/benchmarks.md, 2026-11-27).

libgomp reads the variable once, when torch loads it, so :func:`limit_openmp_spin` runs before ``import torch``
(the ``xscale`` command's entry, inherited by the processes it starts). A user's own ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` wins; ``XSCALE_OPENMP_SPIN=default`` keeps libgomp's default.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT = "10000"
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def limit_openmp_spin(environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to 10,000 in ``environ`` (the process's) unless the user chose a wait policy or torch
    is already loaded (then it could no longer take effect). Returns whether this call set it."""
    environ = os.environ if environ is None else environ
    torch_loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if torch_loaded or environ.get("XSCALE_OPENMP_SPIN") == "default" or any(name in environ for name in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
