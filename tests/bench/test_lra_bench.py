"""``xscale bench lra`` at a tiny size: one row per kind beside the majority baseline, as Markdown, CSV and PNG."""

import argparse
import csv
import json
from pathlib import Path

from xscale.bench.lra import CELLS_FILE, default_kinds, main, run_overrides
from xscale.models.registry import ATTENTION


def test_default_kinds_are_one_name_per_encoder_core():
    kinds = default_kinds()
    assert kinds[:3] == ["dense", "local", "performer"] and len(kinds) == len(set(kinds))
    assert not {"mha", "band", "favor"} & set(kinds) and {"linear", "bigbird", "synthesizer"} <= set(kinds)
    cores = {ATTENTION.get(kind) for kind in kinds}
    assert len(cores) == len(kinds) and all(core.bidirectional_capable for core in cores)
    assert cores == {ATTENTION.get(name) for name in ATTENTION.names() if ATTENTION.get(name).bidirectional_capable}


def test_a_tiny_sweep_writes_the_table(tmp_path, capsys):
    assert main(["--tasks", "pathfinder", "listops", "--kinds", "dense", "--seq-len", "16",
                 "--d-model", "16", "--layers", "1", "--steps", "2", "--batch", "4", "--eval-batches", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "lra.csv").open()))
    assert [(row["task"], row["kind"]) for row in rows] == [("pathfinder", "dense"), ("listops", "dense")]
    assert all(0 <= float(row["accuracy"]) <= 1 and 0.25 <= float(row["majority"]) <= 1 for row in rows)
    # Each cell's own training peak above its built model: a few MB for this model, not the process's running
    # resident peak (hundreds of MB once torch is loaded), which every later cell would otherwise report.
    assert all(0 <= float(row["memory_gb"]) < 0.1 for row in rows), [row["memory_gb"] for row in rows]
    table = (tmp_path / "lra.md").read_text()
    assert "| attention | pathfinder | listops | s/step | peak GB |" in table and "| majority class |" in table
    assert "| dense |" in table and (tmp_path / "lra.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out


def test_a_maskless_kind_runs_and_resume_reuses_finished_cells(tmp_path, capsys):
    args = ["--tasks", "listops", "--kinds", "linear", "--seq-len", "16", "--d-model", "16", "--layers", "1",
            "--steps", "2", "--batch", "4", "--eval-batches", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    first = (tmp_path / CELLS_FILE).read_text().splitlines()
    assert len(first) == 1 and json.loads(first[0])["kind"] == "linear"
    with (tmp_path / CELLS_FILE).open("a") as cells:
        cells.write('{"task": "listops", "kind": "lin')  # a line cut short by a kill mid-write
    assert main([*args, "--resume"]) == 0  # nothing to run again: the file gains no cell
    assert (tmp_path / CELLS_FILE).read_text().splitlines()[:1] == first
    assert sum(1 for line in (tmp_path / CELLS_FILE).read_text().splitlines() if line.endswith("}")) == 1
    assert main([*args, "--steps", "3", "--resume"]) == 0  # another size: the cell runs again
    cells = [json.loads(line) for line in (tmp_path / CELLS_FILE).read_text().splitlines() if line.endswith("}")]
    assert [cell["size"].split(", ")[5] for cell in cells] == ["2 steps of 4", "3 steps of 4"]


def test_pathfinder_cells_pool_by_max_over_sinusoidal_positions_for_twice_the_steps():
    args = argparse.Namespace(d_model=32, layers=1, heads=2, seq_len=128, pooling="mean", steps=50, batch=8, lr=1e-3,
                              eval_batches=2, seed=0)
    pathfinder = run_overrides("pathfinder", "dense", args, Path("out"))
    listops = run_overrides("listops", "dense", args, Path("out"))
    assert {"model.pooling=max", "model.position=sinusoidal", "train.steps=100"} <= set(pathfinder)
    assert {"model.pooling=mean", "model.position=learned", "train.steps=50"} <= set(listops)
