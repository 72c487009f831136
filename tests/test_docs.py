"""The design pages name only what exists: every path and module that docs/architecture.md and docs/extending.md
cite in backquotes is in the tree (a placeholder such as ``<name>`` is skipped)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/architecture.md", "docs/extending.md")
CITED_PATH = re.compile(r"`((?:xscale|tests|configs|docs|launch|kernels|docker)/[^`\s]*)`")
CITED_MODULE = re.compile(r"`(xscale(?:\.[a-z_0-9]+)+)`")


def cited(page: str) -> tuple[list[str], list[str]]:
    text = (ROOT / page).read_text()
    paths = [path for path in CITED_PATH.findall(text) if "<" not in path and "*" not in path]
    return paths, CITED_MODULE.findall(text)


def module_exists(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_path_exists(page):
    paths, _ = cited(page)
    assert paths, f"{page} cites no path: the pattern is wrong"
    assert [path for path in paths if not (ROOT / path).exists()] == []


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_module_exists(page):
    _, modules = cited(page)
    assert [module for module in modules if not module_exists(module)] == []
