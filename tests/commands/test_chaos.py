"""``xscale chaos``: options that cannot make a soak are one line and exit 2, before any job starts."""

from xscale.commands import chaos
from xscale.commands.chaos import main
from xscale.launcher.chaos.plan import PlanError


def test_an_unknown_fault_kind_is_one_line_naming_the_kinds(tmp_path, capsys):
    assert main(["--kinds", "kill_worker,kill_node", "--output-dir", str(tmp_path / "soak")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown fault kind kill_node" in err and "kill_worker" in err


def test_too_few_steps_and_a_used_output_dir_are_refused(tmp_path, capsys):
    assert main(["--faults", "10", "--steps", "20", "--output-dir", str(tmp_path / "soak")]) == 2
    assert "--steps 20 is too few for 10 faults" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    assert main(["--output-dir", str(tmp_path / "used")]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_an_override_in_the_config_place_is_an_override_of_the_built_in_job(tmp_path, monkeypatch):
    seen = []

    def capture(options):
        seen.append(options)
        raise PlanError("captured")

    monkeypatch.setattr(chaos, "run_soak", capture)
    assert main(["train.on_nonfinite=skip", "--output-dir", str(tmp_path / "soak")]) == 2
    assert seen[0].config is None and seen[0].overrides == [*chaos.TINY, "train.on_nonfinite=skip"]
