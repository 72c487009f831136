"""``xscale bench lra`` at a tiny size: one row per kind beside the majority baseline, as Markdown, CSV and PNG."""

import argparse
import csv
import json
from pathlib import Path

import pytest
import torch

from xscale.bench.lra import (
    CELLS_FILE,
    default_kinds,
    first_token_rule_accuracy,
    main,
    run_overrides,
    sweep_cells,
)
from xscale.bench.lra_table import finished_cells, machine_kind, write_table
from xscale.models.registry import ATTENTION

TINY = ["--seq-len", "16", "--d-model", "16", "--layers", "1", "--steps", "2", "--batch", "4", "--eval-batches", "1"]


def test_default_kinds_are_one_name_per_encoder_core():
    kinds = default_kinds()
    assert kinds[:3] == ["dense", "local", "performer"] and len(kinds) == len(set(kinds))
    assert not {"mha", "band", "favor"} & set(kinds) and {"linear", "bigbird", "synthesizer"} <= set(kinds)
    cores = {ATTENTION.get(kind) for kind in kinds}
    assert len(cores) == len(kinds) and all(core.bidirectional_capable for core in cores)
    assert cores == {ATTENTION.get(name) for name in ATTENTION.names() if ATTENTION.get(name).bidirectional_capable}


def test_a_tiny_sweep_writes_the_table(tmp_path, capsys):
    threads = torch.get_num_threads()
    assert main(["--tasks", "pathfinder", "listops", "--kinds", "dense", *TINY, "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "lra.csv").open()))
    assert [(row["task"], row["kind"]) for row in rows] == [("pathfinder", "dense"), ("listops", "dense")]
    assert all(0 <= float(row["accuracy"]) <= 1 and 0.25 <= float(row["majority"]) <= 1 for row in rows)
    # Each cell's own training peak above its built model: a few MB for this model, not the process's running
    # resident peak (hundreds of MB once torch is loaded), which every later cell would otherwise report.
    assert all(0 <= float(row["memory_gb"]) < 0.1 for row in rows), [row["memory_gb"] for row in rows]
    table = (tmp_path / "lra.md").read_text()
    assert "| attention | pathfinder | listops | s/step | peak GB |" in table and "| *majority class* |" in table
    assert f"- listops: {machine_kind()}" in table and "| *best answer per first token* |" in table
    assert "| dense |" in table and (tmp_path / "lra.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    assert torch.get_num_threads() == threads  # the cells ran on one thread; the caller's count is back


def test_a_maskless_kind_runs_and_resume_reuses_finished_cells(tmp_path, capsys):
    args = ["--tasks", "listops", "--kinds", "linear", *TINY, "--out", str(tmp_path)]
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
    assert all(cell["machine"] == machine_kind() and cell["seed"] == 0 for cell in cells)
    # Another task added later (a column per session): the listops cell is reused, only pathfinder's runs.
    assert main([*args, "--tasks", "listops", "pathfinder", "--resume"]) == 0
    cells = [json.loads(line) for line in (tmp_path / CELLS_FILE).read_text().splitlines() if line.endswith("}")]
    assert [cell["task"] for cell in cells] == ["listops", "listops", "pathfinder"]


def test_pathfinder_cells_pool_by_max_over_sinusoidal_positions_for_twice_the_steps():
    args = argparse.Namespace(d_model=32, layers=1, heads=2, seq_len=128, pooling="mean", steps=50, batch=8, lr=1e-3,
                              eval_batches=2, seed=0)
    pathfinder = run_overrides("pathfinder", "dense", args, Path("out"))
    listops = run_overrides("listops", "dense", args, Path("out"))
    assert {"model.pooling=max", "model.position=sinusoidal", "train.steps=100"} <= set(pathfinder)
    assert {"model.pooling=mean", "model.position=learned", "train.steps=50"} <= set(listops)


def test_the_seed_kinds_run_every_seed_and_the_others_the_first():
    cells = sweep_cells(["listops"], ["dense", "linear"], [3, 4, 5], ["dense"])
    assert cells == [("listops", "dense", 3), ("listops", "dense", 4), ("listops", "dense", 5), ("listops", "linear", 3)]


@pytest.mark.slow
def test_seeds_in_parallel_workers_give_the_spread_and_match_one_process(tmp_path):
    """Two seeds of one kind in two one-thread worker processes: each cell's accuracy is the one the same seed gives
    in this process (a worker changes nothing but where it runs), and the table gives mean (min-max)."""
    parallel, serial = tmp_path / "parallel", tmp_path / "serial"
    common = ["--tasks", "listops", "--kinds", "dense", *TINY, "--steps", "4", "--seeds", "0", "1"]
    assert main([*common, "--jobs", "2", "--out", str(parallel)]) == 0
    assert main([*common, "--out", str(serial)]) == 0
    rows = {out: {int(row["seed"]): row for row in csv.DictReader((out / "lra.csv").open())}
            for out in (parallel, serial)}
    assert sorted(rows[parallel]) == [0, 1]
    assert all(rows[parallel][seed]["accuracy"] == rows[serial][seed]["accuracy"] for seed in (0, 1))
    assert all(int(row["threads"]) == 1 and float(row["step_seconds"]) > 0 for row in rows[parallel].values())
    accuracies = [100 * float(rows[parallel][seed]["accuracy"]) for seed in (0, 1)]
    spread = f"{sum(accuracies) / 2:.1f} ({min(accuracies):.1f}-{max(accuracies):.1f})"
    assert f"| dense | {spread} |" in (parallel / "lra.md").read_text()


def test_resume_reuses_only_the_cells_of_this_kind_of_machine(tmp_path):
    """A column keeps to one machine: a cell from another machine stays in the file but is not reused."""
    path = tmp_path / CELLS_FILE
    here = {"task": "listops", "kind": "dense", "seed": 0, "accuracy": 0.3, "size": "S", "machine": machine_kind()}
    there = {**here, "kind": "linear", "machine": "another CPU, AVX2, 64 cores"}
    path.write_text(json.dumps(here) + "\n" + json.dumps(there) + "\n")
    assert list(finished_cells(path, {"listops": "S"}, machine_kind())) == [("listops", "dense", 0)]
    assert list(finished_cells(path, {"listops": "S"}, "another CPU, AVX2, 64 cores")) == [("listops", "linear", 0)]
    assert not finished_cells(path, {"listops": "another size"}, machine_kind())
    assert not finished_cells(path, {"retrieval": "S"}, machine_kind())


def test_the_table_names_each_columns_machines(tmp_path):
    cell = {"task": "listops", "kind": "dense", "seed": 0, "accuracy": 0.31, "majority": 0.12, "step_seconds": 0.2,
            "memory_gb": 0.1, "machine": "A"}
    rows = [cell, {**cell, "seed": 1, "accuracy": 0.29, "machine": "B"}, {**cell, "task": "retrieval", "machine": "A"}]
    table = write_table(rows, tmp_path, "size")
    assert "| dense | 30.0 (29.0-31.0) | 31.0 | 0.200 | 0.10 |" in table
    assert "- listops: A, B\n- retrieval: A" in (tmp_path / "lra.md").read_text()


def test_the_first_token_rule_answers_each_first_tokens_most_frequent_label():
    examples = [(7, 0), (7, 0), (7, 1), (8, 2), (8, 2), (9, 3)]  # (first token, label): 2 + 2 + 1 of 6 right
    dataset = [{"input_ids": torch.tensor([first, 1, 1]), "labels": torch.tensor(label)} for first, label in examples]
    assert first_token_rule_accuracy(dataset, 6) == 5 / 6
    assert first_token_rule_accuracy(dataset, 3) == 2 / 3
