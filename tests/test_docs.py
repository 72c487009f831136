"""The README and the docs pages name only what exists: every path, module and config key they cite in backquotes
is in the tree or the schema (a placeholder such as ``<name>`` is skipped; a key of an earlier release counts when
the loader still reads it)."""

import contextlib
import dataclasses
import functools
import importlib
import io
import os
import re
import types
import typing
from pathlib import Path
from unittest import mock

import pytest

from xscale import cli
from xscale.config import schema
from xscale.config.load import DEPRECATED_KEYS, DEPRECATED_MOVES, DEPRECATED_SWITCHES

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").rglob("*.md")))
CITED_PATH = re.compile(r"`((?:xscale|tests|configs|docs|launch|kernels|docker)/[^`\s]*)`")
CITED_MODULE = re.compile(r"`(xscale(?:\.[A-Za-z_0-9]+)+)`")
# `train.precision`, `parallel.tp=2`, `train.precision: fp32 | bf16`; not a file name such as `model.py`
CITED_KEY = re.compile(r"`((?:model|parallel|train|data|checkpoint|launch)(?:\.[a-z_][a-z_0-9]*)+)(?:[=:][^`]*)?`")
CITED_COMMAND = re.compile(r"`xscale ([a-z][^`]*)`")  # `xscale bench kernels --ce-chunk-tokens N`
COMMANDS_WITH_SUBCOMMANDS = ("bench", "data")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".json", ".txt")
LEGACY_KEYS = {*DEPRECATED_KEYS, *DEPRECATED_SWITCHES, *DEPRECATED_MOVES}


def cited(page: str, pattern: re.Pattern) -> list[str]:
    return [match for match in pattern.findall((ROOT / page).read_text()) if "<" not in match and "*" not in match]


def module_exists(dotted: str) -> bool:
    """A module, or a name defined in one (``xscale.parallel.loss.model_inputs``)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT / Path(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            value = importlib.import_module(".".join(parts[:end]))
            return all((value := getattr(value, name, None)) is not None for name in parts[end:])
    return False


def _field_type(cls: type, name: str) -> type | None:
    hints = typing.get_type_hints(cls)
    if name not in hints:
        return None
    hint = hints[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the X
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def key_exists(key: str) -> bool:
    """A field of the schema's dataclasses; below a component, its ``kind`` or anything under ``options`` (each
    component checks its own options); below a mapping, anything."""
    if key in LEGACY_KEYS:
        return True
    node: type = schema.Config
    for part in key.split("."):
        if node is schema.Component:
            return part in ("kind", "options")
        if typing.get_origin(node) is dict or node is dict:
            return True
        if not dataclasses.is_dataclass(node) or (node := _field_type(node, part)) is None:
            return False
    return True


@functools.cache
def command_help(command: tuple[str, ...]) -> str:
    """What ``xscale COMMAND --help`` prints (in this process: no start-up per command; the environment the command
    sets up, its OpenMP spin count, is put back)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit), \
            mock.patch.dict(os.environ):
        cli.main([*command, "--help"])
    return out.getvalue()


def unknown_command_words(text: str) -> list[str]:
    """The cited ``xscale ...`` commands that do not exist, and the ``--flags`` their command does not take."""
    unknown = []
    for words in (span.split() for span in CITED_COMMAND.findall(text)):
        if words[0] not in cli.COMMANDS:
            if not words[0].endswith(":"):  # a message quoted from a run ("xscale train: ..."), not a command
                unknown.append("xscale " + " ".join(words))
            continue
        command = tuple(words[:2]) if words[0] in COMMANDS_WITH_SUBCOMMANDS and len(words) > 1 else (words[0],)
        flags = [word.split("=")[0] for word in words if word.startswith("--")]
        unknown += [f"xscale {' '.join(command)} {flag}" for flag in flags
                    if not re.search(re.escape(flag) + r"(?![\w-])", command_help(command))]
    return unknown


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_path_exists(page):
    assert [path for path in cited(page, CITED_PATH) if not (ROOT / path).exists()] == []


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_module_exists(page):
    assert [module for module in cited(page, CITED_MODULE) if not module_exists(module)] == []


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_config_key_exists(page):
    keys = [key for key in cited(page, CITED_KEY) if not key.endswith(FILE_SUFFIXES)]
    assert [key for key in keys if not key_exists(key)] == []


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_command_and_flag_exists(page):
    assert unknown_command_words((ROOT / page).read_text()) == []


def test_the_checks_find_what_they_look_for():
    """Each pattern finds its citations, and each check refuses a name that is not there."""
    assert cited("README.md", CITED_PATH) and cited("README.md", CITED_KEY)
    assert cited("docs/extending.md", CITED_MODULE)
    assert key_exists("train.fp8_recipe") and key_exists("model.position.options.theta")
    assert key_exists("model.rope_theta")  # an earlier release's key, still read
    assert not key_exists("train.fp8_recipes") and not key_exists("model.position.theta")
    assert module_exists("xscale.parallel.loss.model_inputs") and not module_exists("xscale.parallel.losses")
    assert unknown_command_words("`xscale bench kernels --ce-chunk-tokens 2048`, `xscale train: lost a peer`") == []
    assert unknown_command_words("`xscale trian x`, `xscale bench kernels --ce-chunk 2`, `xscale plan --gpu=h100`") == [
        "xscale trian x", "xscale bench kernels --ce-chunk", "xscale plan --gpu"]
    assert "--ce-chunk-tokens" in command_help(("bench", "kernels")) and "--compile" in command_help(("bench", "fp8"))
    assert "--ce-chunk" not in re.findall(r"--[\w-]+", command_help(("bench", "kernels")))
    assert module_exists("xscale.runtime.StepContext") and not module_exists("xscale.runtime.StepContexts")
