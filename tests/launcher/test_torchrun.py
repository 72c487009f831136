"""xscale's torchrun: the job's exit code says what the workers meant (3 hung, 130 interrupted)."""

from pathlib import Path

import pytest

import xscale
from xscale.launcher.torchrun import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    WarmStartError,
    job_exit_code,
    main,
    main_file,
    split_warm_option,
)


def test_a_hang_outranks_the_stopped_rank_it_killed():
    assert job_exit_code({0: EXIT_HUNG, 1: -9}) == EXIT_HUNG
    assert job_exit_code({0: -9, 1: EXIT_HUNG}) == EXIT_HUNG


def test_an_interruption_then_the_first_failure_then_a_signal_as_128_plus_it():
    assert job_exit_code({0: EXIT_INTERRUPTED, 1: -15}) == EXIT_INTERRUPTED
    assert job_exit_code({1: 2, 0: 1}) == 1
    assert job_exit_code({0: -9}) == 137
    assert job_exit_code({}) == 1


def test_warm_takes_its_modules_before_the_script_only():
    assert split_warm_option(["--warm", "torch,xscale.commands.train", "--standalone", "-m", "xscale", "train"]) == (
        ["torch", "xscale.commands.train"], ["--standalone", "-m", "xscale", "train"])
    assert split_warm_option(["--nproc-per-node=2", "--warm=torch", "-m", "xscale"]) == (
        ["torch"], ["--nproc-per-node=2", "-m", "xscale"])
    after_the_script = ["--standalone", "-m", "xscale", "train", "--warm", "x"]
    assert split_warm_option(after_the_script) == (None, after_the_script)
    with pytest.raises(WarmStartError, match="needs the modules"):
        split_warm_option(["--warm=", "-m", "xscale"])


def test_warm_runs_the_file_python_dash_m_would():
    assert Path(main_file("xscale")) == Path(xscale.__file__).parent / "__main__.py"
    assert main_file("xscale.launcher.smoke").endswith("xscale/launcher/smoke.py")
    for missing in ("no_such_module", "no_such_package.module"):
        with pytest.raises(WarmStartError, match=f"cannot find the file of module '{missing}'"):
            main_file(missing)


def test_warm_with_no_python_is_one_line_and_exit_2(capsys):
    assert main(["--warm", "torch", "--no-python", "--standalone", "echo"]) == 2
    assert capsys.readouterr().err.strip() == "xscale torchrun: --warm runs Python workers; drop --no-python"


def test_warm_with_a_module_that_does_not_exist_is_one_line_and_exit_2(capsys):
    assert main(["--warm", "torch,xscale.comands.train", "--standalone", "-m", "xscale", "train"]) == 2
    assert capsys.readouterr().err.strip() == ("xscale torchrun: --warm: no module named xscale.comands.train; "
                                               "check the names")
