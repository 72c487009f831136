"""The cells file and the table of ``xscale bench lra``: one JSON line per finished (task, kind, seed) cell, kept
across interrupted sweeps and machines, and the Markdown / CSV / PNG table built from it.

A column of the table comes from one machine: a cell records the machine it ran on (:func:`machine_kind`), and a
resumed sweep reuses only the cells of the same size that ran on a machine of the same kind (another machine's cells
stay in the file, unused). Where a kind ran several seeds, its cell reads ``mean (min-max)`` over them.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path

import torch

from xscale.train.peak_flops import cpu_model

CELLS_FILE = "cells.jsonl"  # one finished (task, kind, seed) cell per line, with its size and machine


def machine_kind() -> str:
    """The CPU's model name, the vector ISA torch dispatches to and the cores this process may use, e.g.
    ``AMD EPYC, AVX512, 2 cores``: timings and bf16 numerics differ between kinds, so a column keeps to one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, {cores} cores"


def cell_key(record: dict) -> tuple[str, str, int]:
    return record["task"], record["kind"], int(record.get("seed", 0))


def finished_cells(path: Path, sizes: dict[str, str], machine: str) -> dict[tuple[str, str, int], dict]:
    """The cells previous (interrupted) sweeps wrote to ``path`` at the size ``sizes[task]`` on a ``machine`` of
    this kind, by (task, kind, seed)."""
    if not path.is_file():
        return {}
    cells = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the sweep was killed mid-write
            continue
        if (isinstance(record, dict) and record.get("machine") == machine
                and record.get("size") == sizes.get(record.get("task"))):
            cells[cell_key(record)] = record
    return cells


def append_cell(path: Path, record: dict) -> None:
    """Add one finished cell to ``path`` on a line of its own (after a line a kill may have cut short)."""
    cut_short = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with path.open("a") as cells:
        cells.write(("\n" if cut_short else "") + json.dumps(record) + "\n")


def _accuracy_text(values: list[float]) -> str:
    """One seed: its accuracy (%); several: ``mean (min-max)``."""
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ({100 * min(values):.1f}-{100 * max(values):.1f})"


def write_table(rows: list[dict], out_dir: Path, size: str) -> str:
    """lra.csv (every cell), lra.md (a row per kind: accuracy per task, dedicated-core seconds per step and peak
    memory, both the mean over its cells) and lra.png under ``out_dir``; returns the Markdown table."""
    rows = [{key: value for key, value in row.items() if key != "size"} for row in rows]
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with (out_dir / "lra.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    by_cell: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        by_cell.setdefault((row["task"], row["kind"]), []).append(row)
    majority = {task: by_cell[(task, kinds[0])][0]["majority"] for task in tasks}
    lines = [f"| attention | {' | '.join(tasks)} | s/step | peak GB |", "|---" * (len(tasks) + 3) + "|",
             "| *majority class* | " + " | ".join(f"{100 * majority[task]:.1f}" for task in tasks) + " | | |"]
    rule = [by_cell[(task, kinds[0])][0].get("first_token_rule") for task in tasks]
    if any(value is not None for value in rule):
        lines.append("| *best answer per first token* | " + " | ".join(
            "" if value is None else f"{100 * value:.1f}" for value in rule) + " | | |")
    for kind in kinds:
        cells = [by_cell.get((task, kind), []) for task in tasks]
        accuracy = " | ".join(_accuracy_text([c["accuracy"] for c in cell]) if cell else "" for cell in cells)
        timed = [c for cell in cells for c in cell]
        seconds = statistics.mean(c["step_seconds"] for c in timed)
        memory = max(c["memory_gb"] for c in timed)
        lines.append(f"| {kind} | {accuracy} | {seconds:.3f} | {memory:.2f} |")
    machines = {task: sorted({c["machine"] for kind in kinds for c in by_cell.get((task, kind), []) if "machine" in c})
                for task in tasks}
    table = "\n".join(lines)
    notes = "\n".join(f"- {task}: {', '.join(names)}" for task, names in machines.items() if names)
    (out_dir / "lra.md").write_text(f"LRA-style eval accuracy (%), {size}\n\n{table}\n\nMachines:\n{notes}\n")
    _plot(by_cell, tasks, kinds, majority, out_dir / "lra.png")
    return table


def _plot(by_cell: dict, tasks: list[str], kinds: list[str], majority: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 1.5 * len(tasks) * max(1, len(kinds)) / 4, 4))
    width = 0.8 / len(kinds)
    for index, kind in enumerate(kinds):
        means = [100 * statistics.mean(c["accuracy"] for c in by_cell[(task, kind)]) if (task, kind) in by_cell
                 else 0.0 for task in tasks]
        ax.bar([t + index * width for t in range(len(tasks))], means, width, label=kind)
    for t, task in enumerate(tasks):
        ax.hlines(100 * majority[task], t - width / 2, t + 0.8 - width / 2, colors="black",
                  linestyles="dashed", label="majority class" if t == 0 else None)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks)
    ax.set_ylabel("eval accuracy %")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
