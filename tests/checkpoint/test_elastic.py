"""Elastic resume: the global batch is kept by gradient accumulation when the data-parallel degree changes, every
sample is read exactly once across 2 -> 1 -> 2 processes, and the run on one process after losing one ends where a
one-process run from the same checkpoint ends (fp32 round-off)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from recorded_training import train_recording

from xscale.checkpoint.elastic import elastic_micro_batch, largest_divisor_at_most
from xscale.commands.parity import PARITY_SETTINGS, run_local
from xscale.config.load import load_config
from xscale.models.batch_statistics import statistics_over_the_microbatch


def test_half_the_ranks_accumulate_two_of_the_checkpoint_s_microbatches():
    micro, line = elastic_micro_batch({"data_parallel": 2, "micro_batch_size": 4}, 8, 1, None)
    assert micro == 4
    assert "global batch 8 kept" in line and "2 microbatch(es) of 4" in line and "gradient accumulation" in line


def test_growing_back_runs_one_microbatch_again():
    micro, line = elastic_micro_batch({"data_parallel": 1, "micro_batch_size": 4}, 8, 2, None)
    assert micro == 4 and "grown back" in line and "accumulation" not in line


def test_nothing_changes_on_the_same_degree_a_set_micro_batch_or_an_older_checkpoint():
    assert elastic_micro_batch({"data_parallel": 2, "micro_batch_size": 4}, 8, 2, None) is None
    assert elastic_micro_batch({"data_parallel": 2, "micro_batch_size": 4}, 8, 1, 8) is None
    assert elastic_micro_batch({}, 8, 1, None) is None


def test_a_model_with_statistics_over_the_microbatch_keeps_one_microbatch_per_rank():
    """MoE routing (capacity, load-balancing loss) reads the routed tokens together: accumulation would change it."""
    micro, line = elastic_micro_batch({"data_parallel": 2, "micro_batch_size": 4}, 8, 1, None,
                                      "Mixture-of-Experts routing statistics")
    assert micro == 8 and "one microbatch of 8" in line and "grows 2x" in line and "Mixture-of-Experts" in line
    assert elastic_micro_batch({"data_parallel": 1, "micro_batch_size": 8}, 8, 2, None, "x") is None  # grown back


def test_what_reads_a_microbatch_as_a_whole():
    moe = load_config(None, ["model.moe.num_experts=4"]).model
    routing = load_config(None, ["model.attention.kind=routing"]).model
    assert "Mixture-of-Experts" in statistics_over_the_microbatch(moe)
    assert "routing attention" in statistics_over_the_microbatch(routing)
    assert statistics_over_the_microbatch(load_config(None, []).model) is None


def test_a_microbatch_that_does_not_divide_the_new_share_becomes_its_largest_divisor_below():
    assert elastic_micro_batch({"data_parallel": 4, "micro_batch_size": 4}, 12, 2, None)[0] == 3
    assert largest_divisor_at_most(6, 4) == 3 and largest_divisor_at_most(7, 4) == 1 and largest_divisor_at_most(4, 9) == 4


SAMPLES, GLOBAL_BATCH, STEPS, EVERY = 64, 8, 8, 3  # 8 steps of 8 = one epoch; checkpoints at steps 3, 6 and 8
MODEL = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.dropout=0.1", f"train.global_batch_size={GLOBAL_BATCH}", "train.seq_len=16", "train.warmup_steps=2",
         "train.lr=3e-3", "data.dataset=copy", f"data.num_samples={SAMPLES}", "data.eval_fraction=0.0",
         f"train.steps={STEPS}", f"checkpoint.every={EVERY}"]
RTOL = 1e-5  # fp32 round-off: the gradient summed over microbatches on one process, not over ranks


def _run(world: int, output_dir: Path, *extra: str) -> list[dict]:
    config = load_config(None, [*MODEL, *PARITY_SETTINGS, f"train.output_dir={output_dir}", "checkpoint.resume=auto",
                                *extra])
    return run_local(train_recording, world, config)


def _keep_only(checkpoints: Path, name: str) -> None:
    """As if the job died right after checkpoint ``name``."""
    for step_dir in checkpoints.glob("step_*"):
        if step_dir.name != name:
            shutil.rmtree(step_dir)
    (checkpoints / "latest").write_text(name + "\n")


@pytest.mark.slow
def test_two_then_one_then_two_processes_read_every_sample_once_and_match_one_process(tmp_path):
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = _run(2, run)  # a node is lost after step 3
    _keep_only(checkpoints, "step_00000003")
    shutil.copytree(checkpoints / "step_00000003", tmp_path / "from3" / "step_00000003")
    shrunk = _run(1, run)[0]  # the job goes on alone: 2 microbatches of 4 per step
    _keep_only(checkpoints, "step_00000006")
    grown = _run(2, run)  # the node is back after step 6
    assert shrunk["micro"] == 4 and [rank["micro"] for rank in grown] == [4, 4]

    # Exactly once: steps 1-3 on two ranks, 4-6 on one, 7-8 on two read the epoch's 64 samples, as the fault-free
    # run does (one epoch of a shuffled order).
    per_step = GLOBAL_BATCH // 2
    seen = Counter(i for rank in first for i in rank["seen"][:EVERY * per_step])
    seen += Counter(shrunk["seen"][:EVERY * GLOBAL_BATCH]) + Counter(i for rank in grown for i in rank["seen"])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, \
        f"read twice: {[i for i, n in seen.items() if n > 1]}, never: {set(range(SAMPLES)) - set(seen)}"

    # The elastic resume (2 x 4 accumulated) against one process from the same checkpoint with one batch of 8.
    alone = _run(1, tmp_path / "alone", f"checkpoint.resume={tmp_path / 'from3' / 'step_00000003'}",
                 "train.micro_batch_size=8")[0]
    assert alone["micro"] == 8 and len(alone["losses"]) == len(shrunk["losses"]) == STEPS - EVERY
    for step, (expected, got) in enumerate(zip(alone["losses"], shrunk["losses"]), start=EVERY + 1):
        assert abs(got - expected) <= RTOL * abs(expected), f"step {step}: {got} elastic vs {expected} one process"
