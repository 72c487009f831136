"""``xscale plan``: the layouts it prints for real configs pass the validator, in seconds; bad input is one line
and exit 2; ``--emit`` writes a config that ``xscale train`` reads."""

from __future__ import annotations

import re

import pytest

from xscale.cli import main
from xscale.config.load import load_config
from xscale.parallel.checks import resolve_layout

H100 = "configs/clusters/h100-ib.yaml"
LAYOUT_ROW = re.compile(r"^\s+\d+\s+(?P<layout>.+?)\s{2,}\d+\.\d GiB")


def _overrides(line: str) -> list[str]:
    return line.removeprefix("run it: ").split()


@pytest.mark.parametrize("config, devices", [
    ("configs/tinyllama-1.1b.yaml", 8), ("configs/tinyllama-1.1b.yaml", 4096),
    ("configs/llama2-7b.yaml", 8), ("configs/llama2-7b.yaml", 4096),
    ("configs/gpt3-175b.yaml", 4096), ("configs/gshard-600b.yaml", 4096),
])
def test_plans_for_real_models_pass_the_validator(capsys, tmp_path, config, devices):
    emitted = tmp_path / "plan.yaml"
    assert main(["plan", config, "--cluster", H100, "--devices", str(devices), "--tokens", "1T", "--top", "3",
                 "--emit", str(emitted)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if LAYOUT_ROW.match(line)]
    assert 1 <= len(rows) <= 3
    run_line = next(line for line in out.splitlines() if line.startswith("run it: "))
    dims, _ = resolve_layout(load_config(config, _overrides(run_line)), devices)
    assert dims.world_size == devices
    chosen = load_config(emitted)
    assert resolve_layout(chosen, devices)[0] == dims
    assert chosen.launch.nodes * chosen.launch.gpus_per_node == devices


@pytest.mark.parametrize("config", ["configs/gpt3-175b.yaml", "configs/gshard-600b.yaml"])
def test_nothing_fits_on_one_node(capsys, config):
    assert main(["plan", config, "--cluster", H100, "--devices", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("xscale plan: nothing fits on 8 devices") and "\n" not in error


def test_bad_cluster_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(H100).read().replace("memory_gib: 74.5", "memory_gib: -1"))
    assert main(["plan", "configs/tinyllama-1.1b.yaml", "--cluster", str(bad), "--devices", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert "memory_gib must be positive" in error and str(bad) in error and "\n" not in error


def test_bad_tokens(capsys):
    assert main(["plan", "configs/tinyllama-1.1b.yaml", "--cluster", H100, "--devices", "8", "--tokens", "lots"]) == 2
    assert "--tokens" in capsys.readouterr().err


def test_missing_cluster_figure_is_one_line(capsys, tmp_path):
    bad = tmp_path / "missing.yaml"
    bad.write_text("\n".join(line for line in open(H100).read().splitlines() if not line.startswith("memory_bandwidth")))
    assert main(["plan", "configs/tinyllama-1.1b.yaml", "--cluster", str(bad), "--devices", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert "memory_bandwidth_gbs is missing" in error and "\n" not in error


@pytest.mark.parametrize("devices", ["0", "4096"])
def test_devices_no_layout_can_use(capsys, devices):
    tiny = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.seq_len=16",
            "train.global_batch_size=2"]
    assert main(["plan", "configs/tiny-gpt.yaml", *tiny, "--cluster", H100, "--devices", devices]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("xscale plan: ") and "devices" in error and "\n" not in error


def test_plan_without_cluster_or_devices(capsys):
    assert main(["plan", "configs/tinyllama-1.1b.yaml"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--cluster, --devices missing" in error and "\n" not in error


@pytest.mark.slow
def test_calibrate_writes_a_cluster_that_plans(capsys, tmp_path):
    out = tmp_path / "here.yaml"
    assert main(["plan", "--calibrate", str(out), "--processes", "2", "--quick"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    tiny = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.seq_len=16",
            "train.global_batch_size=4"]
    assert main(["plan", "configs/tiny-gpt.yaml", *tiny, "--cluster", str(out), "--devices", "2"]) == 0
    assert "run it: " in capsys.readouterr().out


def test_calibrate_needs_two_processes(capsys, tmp_path):
    assert main(["plan", "--calibrate", str(tmp_path / "here.yaml"), "--processes", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--processes must be at least 2" in error and "\n" not in error
    assert not (tmp_path / "here.yaml").exists()
