"""``xscale plan``: the layouts it prints for real configs pass the validator, in seconds; bad input is one line
and exit 2; ``--emit`` writes a config that ``xscale train`` reads."""

from __future__ import annotations

import re

import pytest
import torch

from xscale.cli import main
from xscale.commands.plan import _yaml_value, plan_table
from xscale.config.load import load_config
from xscale.data import with_resolved_vocab
from xscale.estimate.cluster import load_cluster
from xscale.estimate.collective_memory import collective_buffer_bytes
from xscale.estimate.in_flight import blocks_in_flight
from xscale.estimate.layout import Layout
from xscale.estimate.layout_memory import rank_peak
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import placement
from xscale.estimate.search import MEMORY_USABLE, PlanError, search
from xscale.parallel.checks import resolve_layout
from xscale.parallel.parallelize import micro_batch_size
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank
from xscale.parallel.pipeline.cost import stage_layers

H100 = "configs/clusters/h100-ib.yaml"
H200 = "configs/clusters/h200-ib.yaml"
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


def _layout_of(config, dims) -> Layout:
    """The layout a loaded, resolved config runs (read off the config, not the planner's own Layout)."""
    parallel, batch = config.parallel, config.train.global_batch_size
    micro = batch // dims.dp // dims.microbatches if dims.pp > 1 else micro_batch_size(config, dims)
    pipeline = {"schedule": parallel.pp_schedule, "stages_per_rank": parallel.pp_stages_per_rank} if dims.pp > 1 else {}
    return Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp, ep=dims.ep, cp=dims.cp, zero_stage=dims.zero_stage,
                  micro_batch=micro, microbatches=batch // dims.dp // micro,
                  checkpointing=parallel.activation_checkpointing, sequence_parallel=parallel.sequence_parallel,
                  **pipeline)


def _peak_of(shape, cluster, config, dims) -> float:
    """A resolved config's peak per rank, from the memory terms with the pipeline's own split and schedule."""
    layout = _layout_of(config, dims)
    where = placement(config)
    held = [float(len(where.rank_blocks[0]))]
    if dims.pp > 1:
        stages = dims.pp * config.parallel.pp_stages_per_rank
        held = blocks_in_flight(config, dims.pp, stage_to_rank(stages, dims.pp, SCHEDULES[
            config.parallel.pp_schedule].placement), stage_layers(config, stages))
    return (max(rank_peak(shape, config, layout, where, rank, held[rank]).peak for rank in range(dims.pp))
            + collective_buffer_bytes(shape, cluster, layout, where) + cluster.runtime_memory_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 64, 512, 4096])
@pytest.mark.parametrize("config_path", ["configs/tinyllama-1.1b.yaml", "configs/llama2-7b.yaml",
                                         "configs/gpt3-175b.yaml", "configs/gshard-600b.yaml"])
def test_every_printed_row_passes_the_validator_and_the_memory_estimator(config_path, devices):
    """Each of the top rows, not only the emitted one: its overrides load and validate as ``xscale train`` reads
    them, resolve to the printed layout on ``devices`` ranks, and the peak recomputed from that config fits the
    device and is the printed one."""
    cluster = load_cluster(H100)
    base = with_resolved_vocab(load_config(config_path))
    shape = model_shape(base)
    try:
        plans = search(shape, cluster, devices, top=5)
    except PlanError as error:
        assert str(error).startswith(f"nothing fits on {devices} devices") and devices <= 64
        return
    rows = [line for line in plan_table(config_path, base, cluster, devices, plans, 1e12) if LAYOUT_ROW.match(line)]
    assert len(rows) == len(plans) >= min(5, devices)
    for row, plan in zip(rows, plans):
        overrides = [f"{key}={_yaml_value(value)}" for key, value in plan.overrides.items()]
        dims, config = resolve_layout(with_resolved_vocab(load_config(config_path, overrides)), devices)
        assert dims.world_size == devices
        assert _layout_of(config, dims) == plan.layout
        peak = _peak_of(shape, cluster, config, dims)
        assert peak == pytest.approx(plan.peak_bytes, rel=1e-9)
        assert peak <= MEMORY_USABLE * cluster.memory_bytes
        assert LAYOUT_ROW.match(row)["layout"] == plan.layout.describe() and f"{peak / 2**30:.1f} GiB" in row


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
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "attention core (SDPA, causal)" in printed
    grid = load_cluster(out).attention_efficiency  # measured at 2 head dims x 2 lengths, each a share of the peak
    assert len(grid) == 4 and all(0 < fraction <= 1 for _, _, fraction in grid)
    tiny = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.seq_len=16",
            "train.global_batch_size=4"]
    assert main(["plan", "configs/tiny-gpt.yaml", *tiny, "--cluster", str(out), "--devices", "2"]) == 0
    assert "run it: " in capsys.readouterr().out


def test_calibrate_one_device_keeps_the_base_links(capsys, tmp_path):
    out, base = tmp_path / "device.yaml", load_cluster(H200)
    assert main(["plan", "--calibrate", str(out), "--device", "cpu", "--base", H200, "--quick"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    written, text = load_cluster(out), out.read_text()
    for dtype in ("fp32", "bf16"):  # the header's "s=N best / median" rates, TFLOP/s
        best = max(float(rate) for rate in re.findall(r"s=\d+ ([0-9.e+-]+) / ", text.split(f"#   {dtype}: ")[1]
                                                                               .splitlines()[0]))
        assert written.peak_flops[dtype] != base.peak_flops[dtype]
        assert written.peak_flops[dtype] == pytest.approx(best * 1e12, rel=1e-3)
    assert written.links == base.links and written.devices_per_node == base.devices_per_node
    assert written.memory_bandwidth != base.memory_bandwidth and written.device == "cpu"
    assert f"From the base {H200}" in text and "Measured here: peak_tflops" in text
    assert not base.attention_efficiency and len(written.attention_efficiency) == 4  # the quick grid, measured


@pytest.mark.parametrize("arguments, problem", [
    (["--device", "cuda", "--base", H100], "torch sees no cuda device"),
    (["--device", "cpu"], "--base missing"),
    (["--device", "cpu", "--base", "missing.yaml"], "missing.yaml: cannot be read"),
    (["--device", "cpu", "--base", "configs/tiny-gpt.yaml"], "configs/tiny-gpt.yaml: devices_per_node is missing"),
    (["--device", "cpu", "--base", H100, "--processes", "4"], "drop --processes"),
])
def test_calibrate_one_device_refuses_bad_input(capsys, monkeypatch, tmp_path, arguments, problem):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--calibrate", str(tmp_path / "device.yaml"), *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert problem in error and "\n" not in error and "Traceback" not in error
    assert not (tmp_path / "device.yaml").exists()


def test_calibrate_needs_two_processes(capsys, tmp_path):
    assert main(["plan", "--calibrate", str(tmp_path / "here.yaml"), "--processes", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--processes must be at least 2" in error and "\n" not in error
    assert not (tmp_path / "here.yaml").exists()
