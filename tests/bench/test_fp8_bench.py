"""``xscale bench fp8``: both runs train, the report parses, the loss curves are kept, bad arguments exit 2."""

from __future__ import annotations

import json
import re

import pytest

from xscale.bench.fp8 import main

pytest.importorskip("torchao.float8", reason="train.precision=fp8 needs torchao (in the dev extras)")
TINY = ["data.dataset=copy", "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
        "train.seq_len=16", "train.global_batch_size=8", "train.warmup_steps=2", "train.lr=3e-3"]


def test_both_runs_train_and_the_report_gives_the_ratio_and_the_loss_difference(tmp_path, capsys):
    assert main([*TINY, "--steps", "8", "--warmup", "2", "--tail", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rates = dict(re.findall(r"^(bf16|fp8)\s+([\d.]+) tokens/s", out, re.MULTILINE))
    assert rates.keys() == {"bf16", "fp8"} and all(float(rate) > 0 for rate in rates.values())
    ratio = float(re.search(r"ratio fp8 / bf16 tokens/s: ([\d.]+)x", out)[1])
    assert ratio == pytest.approx(float(rates["fp8"]) / float(rates["bf16"]), rel=2e-3)
    difference = float(re.search(r"loss fp8 vs bf16 over the last 2 steps: ([+-][\d.]+)%", out)[1])
    assert abs(difference) < 1.0, out
    for precision in ("bf16", "fp8"):
        records = [json.loads(line) for line in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()]
        losses = [record["train/loss"] for record in records if "train/loss" in record]
        assert len(losses) == 8 and losses[-1] < losses[0], (precision, losses)
        assert not (tmp_path / precision / "checkpoints").exists()  # checkpoint.every=-1: a 1B run saves nothing


@pytest.mark.parametrize("flags", [["--steps", "5", "--warmup", "5"], ["--steps", "5", "--tail", "6"]])
def test_bad_step_counts_exit_2_with_one_line(flags, capsys):
    assert main([*TINY, *flags]) == 2
    assert "xscale bench fp8: --steps 5 must exceed --warmup" in capsys.readouterr().out
