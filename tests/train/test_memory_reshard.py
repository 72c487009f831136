"""Transformer-XL's segment memory regrouped for another layout on resume: hand-built per-rank memories of one
layout cut for another (data parallelism, microbatches, tensor-parallel replicas), the refusals, and a resume on
another layout continuing the uninterrupted run's losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xscale.checkpoint.checkpointer import CheckpointError
from xscale.commands.parity import PARITY_SETTINGS, run_local
from xscale.config.load import load_config
from xscale.data import GlobalSampler
from xscale.data.datasets import ArrayTokens, PackedTextDataset
from xscale.data.objectives import causal_lm
from xscale.models.segment_memory import SegmentMemory, memory_name
from xscale.train.memory_reshard import MemoryRows, StreamMemory, parse_memory_name
from xscale.train.recurrence import MEMORY_FILES, MEMORY_META_KEY, load_memory
from xscale.train.trainer import Trainer

STREAMS, LAYERS, LENGTH, WIDTH = 4, 2, 3, 2


def stream_memory(layer: int) -> torch.Tensor:
    """Layer ``layer``'s memory of every stream (row r: stream r), each value telling its stream, layer and place."""
    return torch.arange(STREAMS * LENGTH * WIDTH, dtype=torch.float32).reshape(STREAMS, LENGTH, WIDTH) + 100 * layer


def rows_of(*rows: int) -> torch.Tensor:
    """The memory of global rows ``rows`` at every layer, stacked by layer."""
    return torch.stack([stream_memory(layer)[list(rows)] for layer in range(LAYERS)])


# Each layout's per-rank memories written out by hand: name "(first row, layer)" -> rows of that microbatch.
# dp=2 with microbatches of 1 row: rank 0 runs global rows 0 then 2, rank 1 rows 1 then 3.
DP2_MICRO1 = [{f"({first}, {layer})": rows_of(first)[layer] for first in firsts for layer in range(LAYERS)}
              for firsts in ((0, 2), (1, 3))]
# One process, microbatches of 2 rows.
ONE_MICRO2 = [{f"({first}, {layer})": rows_of(first, first + 1)[layer] for first in (0, 2) for layer in range(LAYERS)}]
# tp=2 on one data-parallel rank: both ranks hold the whole batch (replicas).
TP2 = [{f"(0, {layer})": rows_of(0, 1, 2, 3)[layer] for layer in range(LAYERS)} for _ in range(2)]


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("saved", [DP2_MICRO1, ONE_MICRO2, TP2], ids=["dp2-micro1", "one-micro2", "tp2"])
def test_every_layout_regroups_into_every_other(saved):
    """Saved by one layout, cut for each rank of another: exactly that layout's hand-built memories."""
    memory = StreamMemory(saved, STREAMS)
    assert_same(memory.cut(MemoryRows((0, 2), 1)), DP2_MICRO1[0])
    assert_same(memory.cut(MemoryRows((1, 3), 1)), DP2_MICRO1[1])
    assert_same(memory.cut(MemoryRows((0, 2), 2)), ONE_MICRO2[0])
    assert_same(memory.cut(MemoryRows((0,), 4)), TP2[0])


def test_compressed_memory_regroups_beside_the_memory():
    compressed = {f"({first}, 0)/compressed": rows_of(first)[0][:, :1] * -1 for first in range(STREAMS)}
    memory = StreamMemory([{**ONE_MICRO2[0], **compressed}], STREAMS)
    cut = memory.cut(MemoryRows((1,), 2))
    assert torch.equal(cut["(1, 0)/compressed"], torch.cat([compressed["(1, 0)/compressed"],
                                                            compressed["(2, 0)/compressed"]]))
    assert torch.equal(cut["(1, 1)"], rows_of(1, 2)[1])


@pytest.mark.parametrize("dp_size,local,microbatches", [(1, 4, 1), (1, 4, 2), (2, 2, 1), (2, 2, 2), (4, 1, 1)])
def test_a_ranks_rows_are_the_rows_the_sampler_gives_it(dp_size, local, microbatches):
    """MemoryRows.of_rank names the global rows GlobalSampler.shard hands the rank, microbatch by microbatch."""
    for dp_rank in range(dp_size):
        rows = MemoryRows.of_rank(dp_rank, dp_size, local, microbatches)
        read = GlobalSampler.shard(list(range(dp_size * local)), dp_rank, dp_size, microbatches)
        assert [first + row for first in rows.first_rows for row in range(rows.rows)] == read


def test_names_are_the_blocks_keys_as_text():
    memory = SegmentMemory(length=2, compressed_length=2)
    memory.exchange((3, 1), torch.zeros(1, 4, WIDTH))
    memory.record_compressed((3, 1), torch.zeros(1, 1, WIDTH))
    assert sorted(memory.recorded) == [memory_name(3, 1), memory_name(3, 1, compressed=True)]
    assert [parse_memory_name(name) for name in sorted(memory.recorded)] == [(3, 1, False), (3, 1, True)]
    with pytest.raises(CheckpointError, match="not the name of a segment memory"):
        parse_memory_name("layer 3")


def test_what_cannot_be_regrouped_is_refused_with_what_to_change():
    with pytest.raises(CheckpointError, match="resume with train.global_batch_size=4"):
        StreamMemory(DP2_MICRO1, 8)  # 8 streams now: other windows on every row
    with pytest.raises(CheckpointError, match="lacks global rows 1..1"):
        StreamMemory(DP2_MICRO1[:1], STREAMS)  # rank 1's file lost
    memory = StreamMemory(TP2, STREAMS)
    for layers, width, length, option in ((3, WIDTH, LENGTH, "model.n_layers=3"), (LAYERS, 4, LENGTH, "d_model=4"),
                                          (LAYERS, WIDTH, 2, "model.segment_memory=2")):
        with pytest.raises(CheckpointError, match=option):
            memory.check_model(layers, width, length, 0)
    memory.check_model(LAYERS, WIDTH, LENGTH, 0)


def test_load_memory_reads_every_rank_and_refuses_other_streams_and_missing_files(tmp_path):
    (tmp_path / MEMORY_FILES).mkdir()
    for rank, state in enumerate(DP2_MICRO1):
        torch.save(state, tmp_path / MEMORY_FILES / f"rank_{rank:05d}.pt")
    saved = {"layout": "dp_shard=2", "world_size": 2, "local_batch_size": 2, "micro_batch_size": 1,
             "train.global_batch_size": STREAMS, "model.n_layers": LAYERS, "model.d_model": WIDTH,
             "model.segment_memory": LENGTH, "model.compressed_memory": 0}
    meta = {MEMORY_META_KEY: saved}
    expected = {**saved, "layout": "single", "world_size": 1, "local_batch_size": 4, "micro_batch_size": 2}
    memory = SegmentMemory(LENGTH)
    regrouped = load_memory(memory, tmp_path, meta, expected, MemoryRows((0, 2), 2), "cpu")
    assert "regrouped the segment memory of 'dp_shard=2' (2 processes" in regrouped
    assert_same(memory.current, ONE_MICRO2[0])
    with pytest.raises(CheckpointError, match=r"train.global_batch_size=4 \(this run: 8\)"):
        load_memory(memory, tmp_path, meta, {**expected, "train.global_batch_size": 8}, MemoryRows((0,), 8), "cpu")
    (tmp_path / MEMORY_FILES / "rank_00001.pt").unlink()
    with pytest.raises(CheckpointError, match="lacks rank_00001.pt of the 2 ranks"):
        load_memory(memory, tmp_path, meta, expected, MemoryRows((0, 2), 2), "cpu")


# ---------------------------------------------------------------- the trainer, resuming on another layout
SEQ, BATCH, WINDOWS_PER_STREAM = 8, 4, 6  # no stream restart within the 4 steps: the memory matters at each
TINY = ["model.vocab_size=32", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.position=xl",
        "model.segment_memory=8", "model.dropout=0.1", "data.order=streams", "data.dataset=text",
        f"train.global_batch_size={BATCH}", f"train.seq_len={SEQ}", "train.warmup_steps=2", "train.lr=3e-3",
        "train.peak_flops=1e12", "train.watchdog=false", *PARITY_SETTINGS]
RTOL = 1e-5


def datasets() -> tuple[PackedTextDataset, None]:
    windows = BATCH * WINDOWS_PER_STREAM
    tokens = np.random.default_rng(0).integers(0, 32, (windows + 1) * SEQ + 1).astype(np.int32)
    tokens[::3] = tokens[1::3][: len(tokens[::3])]  # some structure a memory can use
    transform = lambda window, generator: causal_lm(window)  # noqa: E731
    return PackedTextDataset(ArrayTokens(tokens), SEQ + 1, transform, seed=0, stride=SEQ, num_windows=windows), None


def train(output_dir: str, *extra: str) -> list[float]:
    config = load_config(None, [*TINY, f"train.output_dir={output_dir}", "checkpoint.resume=auto", *extra])
    return Trainer(config, *datasets()).fit()["losses"]


def assert_continues(resumed: list[float], reference: list[float]) -> None:
    for step, (got, expected) in enumerate(zip(resumed, reference[-len(resumed):], strict=True), start=3):
        assert abs(got - expected) <= RTOL * abs(expected), f"step {step}: {got} after resume vs {expected}"


def test_resume_with_another_micro_batch_size_continues_the_run(tmp_path):
    """The run's step-2 checkpoint (one microbatch of 4 rows) resumed in microbatches of 2 rows: the run's losses."""
    reference = train(tmp_path / "reference", "train.steps=4", "checkpoint.every=2")
    resumed = train(tmp_path / "run", "train.steps=4", "train.micro_batch_size=2",
                    f"checkpoint.resume={tmp_path / 'reference' / 'checkpoints' / 'step_00000002'}")
    assert_continues(resumed, reference)


def test_resume_with_another_global_batch_is_refused(tmp_path):
    train(tmp_path, "train.steps=2")
    with pytest.raises(CheckpointError, match="train.global_batch_size=4"):
        train(tmp_path, "train.steps=4", "train.global_batch_size=2")


@pytest.mark.slow
def test_memory_saved_by_two_processes_resumes_on_one(tmp_path):
    """2 steps on dp_shard=2 (ZeRO-3, microbatches of 1 row: rank 0 holds rows 0 and 2, rank 1 rows 1 and 3), 2 more
    on one process in one microbatch: the losses of 4 uninterrupted steps on one process."""
    reference = train(tmp_path / "reference", "train.steps=4")
    run_local(train, 2, str(tmp_path / "run"), "train.steps=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
              "train.micro_batch_size=1")
    assert_continues(train(tmp_path / "run", "train.steps=4"), reference)
