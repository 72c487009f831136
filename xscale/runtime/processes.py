"""Whether a process still runs, for the run lock's stale-holder check and the chaos soak's waits."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs: it exists (another user's counts) and is no zombie (one that
    exited and waits for its parent to reap it is gone for every purpose here)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): existing is all that can be told
        return True
