"""The CPU's instruction-set flags, as Linux reports them (``/proc/cpuinfo``)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
