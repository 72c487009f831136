"""Workers that end with their launcher: a torchrun worker whose agent died must not keep training.

Without this, killing torchrun's agent leaves its workers training and writing checkpoints, and a restarted job
writes beside them. Linux delivers ``PR_SET_PDEATHSIG`` to a process when its parent exits; under torchrun (which
sets ``TORCHELASTIC_RUN_ID`` for its workers) each worker asks for SIGKILL then: the job's state is its last
checkpoint. A single process started from a shell is left alone (``nohup xscale train &`` outlives its shell).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def exit_with_launcher(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Ask to be killed when the torchrun agent exits; returns whether it was asked (Linux under torchrun)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in environ:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the agent died before the request: the death signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    return True
