"""Byte counts as people read them: ``3.2 MiB``, ``1.05 GiB``, ``512 B``."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def readable_size(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1, with three significant figures
    (``3.21 MiB``, ``45.6 MiB``, ``512 MiB``); whole bytes below 1 KiB."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(count)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {UNITS[unit]}"
