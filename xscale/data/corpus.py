"""A real-text corpus present on every machine: the docstrings of the Python standard library.

Modules are read as source and parsed with ``ast``, never imported, so nothing runs and nothing is
cached. The order is fixed (sorted module names, then sorted file paths inside packages); the text is
the same on every machine with the same Python version, and so on every rank of a job.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Packages that distributions split out or strip (tests, GUIs, deprecated tools): leaving them out keeps the
# corpus the same whether or not a machine has them.
_EXCLUDED = frozenset({
    "test", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "distutils", "ensurepip", "venv",
    "pydoc_data", "antigravity", "this", "msilib", "winreg", "winsound", "nt", "_msi", "_winapi"
})
DEFAULT_MAX_BYTES = 4_000_000


def stdlib_module_names() -> list[str]:
    """Public top-level standard-library modules that ship as Python source here, sorted."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _EXCLUDED:
            continue
        if _source_files(name):
            names.append(name)
    return names


def _source_files(module_name: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    origin = Path(spec.origin)
    if origin.name != "__init__.py":
        return [origin]
    package = origin.parent
    return sorted((path for path in package.rglob("*.py")
                   if not any(part.startswith("test") or part == "idle_test"
                              for part in path.relative_to(package).parts)),
                  key=lambda path: path.relative_to(package).as_posix())


def module_docstrings(path: Path) -> str:
    """The module, class and function docstrings of one source file, in source order, blank-line separated."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return ""
    nodes = [tree] + [node for node in ast.walk(tree)
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))
    docstrings = [ast.get_docstring(node, clean=True) for node in nodes]
    return "\n\n".join(doc.strip() for doc in docstrings if doc and doc.strip())


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """One document per source file, in a fixed order, until about ``max_bytes`` of UTF-8 text."""
    total = 0
    for name in stdlib_module_names():
        for path in _source_files(name):
            text = module_docstrings(path)
            if not text:
                continue
            yield text
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                return


def text_documents(path: str | Path, text_field: str = "text", jsonl: bool | None = None) -> Iterator[str]:
    """Documents of a user corpus: a ``.txt`` file is one document, a ``.jsonl`` line's ``text_field`` is one
    (Megatron's preprocessing input); a folder gives those of its .txt/.jsonl files in sorted path order.
    ``jsonl`` True/False reads a single file as JSON lines / plain text whatever its suffix."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
        if not files:
            raise ValueError(f"{path} holds no .txt or .jsonl files; point data.path at a text file or folder")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"text corpus {path} does not exist; set data.path to a .txt/.jsonl file or a folder")
    for file in files:
        as_jsonl = file.suffix == ".jsonl" if jsonl is None or path.is_dir() else jsonl
        try:
            yield from _file_documents(file, text_field, as_jsonl)
        except UnicodeDecodeError as error:
            raise _not_text(file, f"undecodable byte at offset {error.start}") from None


def _not_text(file: Path, why: str) -> ValueError:
    return ValueError(f"{file} is not UTF-8 text ({why}); data.dataset=text reads .txt/.jsonl text, token files "
                      "(.bin/.idx) are data.dataset=indexed")


def _file_documents(file: Path, text_field: str, jsonl: bool) -> Iterator[str]:
    if jsonl:
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield _jsonl_text(line, file, number, text_field)
    else:
        text = file.read_text(encoding="utf-8")
        if "\x00" in text:  # valid UTF-8 but binary: e.g. small token ids stored as integers
            raise _not_text(file, f"a NUL byte at offset {text.encode('utf-8').index(0)}")
        if text.strip():
            yield text


def _jsonl_text(line: str, file: Path, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
        text = record[text_field]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{file}:{number} is not a JSON object with a \"{text_field}\" field ({error}); "
                         "data.text_field (--text-field) names the field that holds the text") from error
    if not isinstance(text, str):
        raise ValueError(f"{file}:{number}: \"{text_field}\" must be a string")
    return text
