"""Plain-text help: reStructuredText markup removed from what argparse prints; usage errors in one line."""

import pytest

from xscale.commands.parser import CommandParser, plain


def test_plain_removes_literals_and_roles():
    assert plain("``xscale export CKPT``: see :func:`~xscale.train.step.optimizer_step` and :mod:`xscale.data`") == (
        "xscale export CKPT: see optimizer_step and xscale.data")
    assert plain(":py:class:`torch.nn.Linear` and `single` quotes") == "torch.nn.Linear and `single` quotes"


def test_the_parser_prints_plain_help_and_one_line_errors(capsys):
    parser = CommandParser(prog="xscale demo", description="Reads ``CONFIG`` (:class:`~xscale.config.Config`).")
    parser.add_argument("--steps", type=int, help="like ``train.steps``")
    parser.print_help()
    out = capsys.readouterr().out
    assert "Reads CONFIG (Config)." in out and "like train.steps" in out and "`" not in out
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--steps", "x"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("xscale demo: argument --steps: invalid int value: 'x' "
                                       "(see xscale demo --help)\n")
