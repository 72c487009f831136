"""keep_freed_memory: glibc's mallopt applied once (both settings accepted), or nothing when the user opts out.

Its effect is measured, not asserted: glibc's own dynamic threshold sometimes reaches the same steady state in a
toy allocation loop, so only ``xscale bench moe`` (with and without XSCALE_SYSTEM_MALLOC=1) shows it.
"""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

APPLIED = ("from xscale.launcher import cpu_allocator as a; first = a.keep_freed_memory(); "
           "print(first, a.keep_freed_memory())")


def run(code: str, system_malloc: str) -> str:
    env = {**os.environ, "XSCALE_SYSTEM_MALLOC": system_malloc}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_applied_once_and_left_alone_when_opted_out():
    assert run(APPLIED, "0").split() == ["True", "True"]
    assert run(APPLIED, "1").split() == ["False", "False"]
