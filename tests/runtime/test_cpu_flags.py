"""The CPU's flags from /proc/cpuinfo, and none where it cannot be read."""

from pathlib import Path

from xscale.runtime import cpu_flags as module
from xscale.runtime.cpu_flags import cpu_flags


def test_the_flags_line_is_read_and_an_unreadable_file_gives_none(monkeypatch):
    text = "processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_int8\nbugs\t\t: spectre\n"
    monkeypatch.setattr(module.Path, "read_text", lambda self: text)
    assert cpu_flags() == {"fpu", "sse2", "avx512f", "amx_int8"}

    def unreadable(self: Path) -> str:
        raise PermissionError(str(self))

    monkeypatch.setattr(module.Path, "read_text", unreadable)
    assert cpu_flags() == set()
