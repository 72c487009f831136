"""``xscale bench lra`` at a tiny size: one row per kind beside the majority baseline, as Markdown, CSV and PNG."""

import csv

from xscale.tools.bench.lra import default_kinds, main


def test_default_kinds_are_one_name_per_maskable_core():
    kinds = default_kinds()
    assert kinds[0] == "dense" and "mha" not in kinds and "linear" not in kinds and "synthesizer" in kinds


def test_a_tiny_sweep_writes_the_table(tmp_path, capsys):
    assert main(["--tasks", "pathfinder", "listops", "--kinds", "dense", "--seq-len", "16",
                 "--d-model", "16", "--layers", "1", "--steps", "2", "--batch", "4", "--eval-batches", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "lra.csv").open()))
    assert [(row["task"], row["kind"]) for row in rows] == [("pathfinder", "dense"), ("listops", "dense")]
    assert all(0 <= float(row["accuracy"]) <= 1 and 0.25 <= float(row["majority"]) <= 1 for row in rows)
    table = (tmp_path / "lra.md").read_text()
    assert "| attention | pathfinder | listops | s/step | peak GB |" in table and "| majority class |" in table
    assert "| dense |" in table and (tmp_path / "lra.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
