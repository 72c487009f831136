"""What every xscale command's argument parser does: help in plain text, usage errors in one line.

Module docstrings cite code in reStructuredText (double backquotes, roles such as ``:func:``); argparse would print
that markup as it is, so :class:`CommandParser` reads its description and every argument's help through
:func:`plain`. A usage error is one line on stderr and exit code 2, like every other refusal of bad input.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")  # :func:`~xscale.a.b` -> b, :mod:`xscale.a` -> xscale.a
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup: literals unquoted, roles replaced by their target (the last
    dotted part when the target starts with ``~``, as Sphinx shows it)."""
    text = _ROLE.sub(lambda match: match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2), text)
    return _LITERAL.sub(r"\1", text)


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with plain-text help and one-line usage errors."""

    def __init__(self, *args: Any, description: str | None = None, epilog: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, description=plain(description) if description else None,
                         epilog=plain(epilog) if epilog else None, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if isinstance(kwargs.get("help"), str):
            kwargs["help"] = plain(kwargs["help"])
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _SubcommandFormatter(argparse.HelpFormatter):
    """Help whose description column clears the longest subcommand name (argparse measures only the options)."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            longest = max((len(name) for name in action.choices), default=0)
            self._action_max_length = max(self._action_max_length, longest + self._current_indent + 2)


def print_command_help(prog: str, description: str, title: str, commands: dict[str, str],
                       version: bool = False) -> None:
    """The help of a command made of subcommands (``xscale``, ``xscale data``, ``xscale bench``), in one layout:
    usage, description, options, then each subcommand with its one-line description under ``title``."""
    parser = CommandParser(prog=prog, description=description, formatter_class=_SubcommandFormatter)
    if version:
        parser.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(title=title, metavar=title.rstrip("s").upper())
    for name, help_text in commands.items():
        sub.add_parser(name, help=help_text)
    parser.print_help()
