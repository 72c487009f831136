"""xscale/launcher/openmp_spin.py: a shorter libgomp spin-wait, set before torch loads, never over the user's."""

import subprocess
import sys

import pytest

import xscale.cli
from xscale.launcher.openmp_spin import SPIN_COUNT, limit_openmp_spin


def test_sets_the_spin_count_before_torch_loads():
    environ = {"PATH": "/bin"}
    assert limit_openmp_spin(environ, torch_loaded=False)
    assert environ["GOMP_SPINCOUNT"] == SPIN_COUNT


@pytest.mark.parametrize("user", [{"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "ACTIVE"},
                                  {"XSCALE_OPENMP_SPIN": "default"}])
def test_the_users_setting_wins(user):
    environ = dict(user)
    assert not limit_openmp_spin(environ, torch_loaded=False)
    assert environ == user


def test_short_is_the_default_by_name():
    environ = {"XSCALE_OPENMP_SPIN": "short"}
    assert limit_openmp_spin(environ, torch_loaded=False)
    assert environ["GOMP_SPINCOUNT"] == SPIN_COUNT


def test_an_unknown_choice_is_an_error_not_ignored(monkeypatch, capsys):
    with pytest.raises(ValueError, match="XSCALE_OPENMP_SPIN='off' is not one of short, default"):
        limit_openmp_spin({"XSCALE_OPENMP_SPIN": "off"}, torch_loaded=False)
    monkeypatch.setenv("XSCALE_OPENMP_SPIN", "off")
    assert xscale.cli.main(["inspect"]) == 2
    assert "XSCALE_OPENMP_SPIN='off'" in capsys.readouterr().err


def test_nothing_once_torch_is_loaded():
    """libgomp has read its environment by then: setting the variable would claim an effect it cannot have."""
    environ = {}
    assert not limit_openmp_spin(environ, torch_loaded=True)
    assert environ == {}


def test_a_fresh_process_sees_it_when_torch_loads():
    code = ("import os, sys; from xscale.launcher.openmp_spin import limit_openmp_spin; "
            "print(limit_openmp_spin(), 'torch' in sys.modules); import torch; print(os.environ['GOMP_SPINCOUNT'])")
    env = {key: value for key, value in __import__("os").environ.items()
           if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "XSCALE_OPENMP_SPIN")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False", SPIN_COUNT]


def test_the_command_sets_it_before_importing_the_subcommand(monkeypatch):
    order = []
    monkeypatch.setattr(xscale.cli, "limit_openmp_spin", lambda: order.append("spin"))
    monkeypatch.setattr(xscale.cli.importlib, "import_module",
                        lambda name: order.append(name) or type("M", (), {"main": staticmethod(lambda argv: 0)}))
    assert xscale.cli.main(["inspect"]) == 0
    assert order == ["spin", "xscale.commands.inspect"]
