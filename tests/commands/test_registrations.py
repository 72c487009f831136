"""Each command registers every layer's config checks before it reads a config (a fresh interpreter: nothing else
imported first)."""

import subprocess
import sys

import pytest

from xscale.cli import COMMANDS
from xscale.commands.registrations import PROVIDERS

PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
from xscale.checkpoint.init_sources import _SOURCES
from xscale.config.check import check_providers
from xscale.config.load import _COMPLETERS
print(sorted(check_providers()), sorted(_SOURCES), len(_COMPLETERS))
"""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_registers_every_layer_before_reading_a_config(command):
    module = COMMANDS[command][0]
    result = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, check=True)
    assert all(provider in result.stdout for provider in PROVIDERS), result.stdout
    assert "'hf'" in result.stdout and result.stdout.strip().endswith("1"), result.stdout
