"""process_alive: this process runs; a child that exited is gone whether or not it was reaped yet."""

import os
import subprocess
import sys
import time

from xscale.runtime.processes import process_alive


def test_this_process_is_alive():
    assert process_alive(os.getpid())


def test_an_exited_child_is_gone_before_and_after_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while process_alive(child.pid) and time.time() < deadline:  # a zombie until wait() reaps it
        time.sleep(0.01)
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid)


def test_no_pid_is_no_process():
    assert not process_alive(0) and not process_alive(-1)
