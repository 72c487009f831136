"""Transformer-XL recurrence in the trainer: the memory carried across steps, reset, checkpointed, evaluated (resumed\non another layout: tests/train/test_memory_reshard.py)."""

from __future__ import annotations

import numpy as np
import pytest

from xscale.checkpoint.checkpointer import load_per_rank
from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.data.datasets import ArrayTokens, PackedTextDataset
from xscale.data.objectives import causal_lm
from xscale.train.trainer import Trainer

SEQ, BATCH, STREAM = 8, 4, 3  # 4 streams of 3 windows: the streams restart every 3 steps
TINY = [
    "model.vocab_size=32", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.position=xl",
    "model.segment_memory=8", "model.dropout=0.1", "data.order=streams", "data.dataset=text",
    f"train.global_batch_size={BATCH}", f"train.seq_len={SEQ}", "train.warmup_steps=2", "train.log_every=100",
    "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.peak_flops=1e12",
    "train.watchdog=false",
]


def datasets(windows: int = BATCH * STREAM, eval_windows: int = 8) -> tuple[PackedTextDataset, PackedTextDataset]:
    tokens = np.random.default_rng(0).integers(0, 32, (windows + eval_windows) * SEQ + 1).astype(np.int32)
    tokens[::3] = tokens[1::3][: len(tokens[::3])]  # some structure a memory can use
    stream = ArrayTokens(tokens)
    transform = lambda window, generator: causal_lm(window)  # noqa: E731
    train = PackedTextDataset(stream, SEQ + 1, transform, seed=0, stride=SEQ, num_windows=windows)
    evaluation = PackedTextDataset(stream, SEQ + 1, transform, seed=0, stride=SEQ, first_window=windows,
                                   num_windows=eval_windows)
    return train, evaluation


def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*TINY, f"train.output_dir={tmp_path}", *extra]), *datasets())


COMPRESSIVE = ["model.compressed_memory=8", "model.compression_rate=2"]


@pytest.mark.parametrize("extra", [[], COMPRESSIVE], ids=["xl", "compressive"])
def test_resume_continues_bitwise_with_the_memory(tmp_path, extra):
    """4 steps == 2 + resume + 2 (the resume mid-stream, a stream restart after it), losses bit for bit; with a
    compressed memory too (filled from step 1, its f_c trained by the reconstruction loss)."""
    full = trainer(tmp_path / "full", "train.steps=4", *extra).fit()
    trainer(tmp_path / "split", "train.steps=2", *extra).fit()
    resumed = trainer(tmp_path / "split", "train.steps=4", *extra)
    assert resumed.fit()["losses"] == full["losses"][2:]
    saved = load_per_rank(tmp_path / "split" / "checkpoints" / "step_00000002", "segment_memory")
    assert any(name.endswith("/compressed") for name in saved) == bool(extra)


def test_memory_is_reset_when_the_streams_restart(tmp_path):
    """With updates too small to change a weight, the restart step reads step 0's windows with an empty memory:
    the same loss as step 0 (with the memory of the streams' ends it would differ)."""
    losses = trainer(tmp_path, f"train.steps={STREAM + 1}", "train.lr=1e-30", "train.warmup_steps=0",
                     "model.dropout=0.0").fit()["losses"]
    assert losses[STREAM] == losses[0]
    assert losses[1] != losses[0]


@pytest.mark.parametrize("core", [[], ["model.position=rope", "model.attention.kind=local",
                                       "model.attention.options={window: 4, block_size: 4}"]],
                         ids=["xl-dense", "rope-local"])
def test_evaluation_reports_the_loss_with_and_without_memory(tmp_path, core):
    """The memory reaches the loss, for a core without a logit bias too (RoPE over [memory ; segment]: relative, so
    the band's loss would not change if the remembered keys were dropped)."""
    scalars = trainer(tmp_path, "train.steps=1", "train.eval_batches=2", *core).evaluate()
    assert set(scalars) >= {"eval/loss", "eval/loss_memory", "eval/loss_no_memory"}
    assert scalars["eval/loss_memory"] != scalars["eval/loss_no_memory"]


def test_streams_need_consecutive_windows(tmp_path):
    config = load_config(None, [*TINY, f"train.output_dir={tmp_path}", "data.dataset=copy"])
    with pytest.raises(ConfigError, match="data.order=streams"):
        Trainer(config, list(range(8)), None)


def test_a_memory_snapshot_carries_the_segment_memory(tmp_path, capsys):
    """checkpoint.memory_every: a run that dies before any disk checkpoint resumes the step in memory with the
    rows' remembered layer inputs, losses bit for bit (the resumed step 2 reads step 1's memory)."""
    full = trainer(tmp_path / "full", "train.steps=3").fit()
    crashing = trainer(tmp_path / "crashed", "train.steps=3", "checkpoint.memory_every=1")
    train_step = crashing.train_step

    def crash_before_step_2() -> dict[str, float]:
        if crashing.step == 1:
            raise RuntimeError("worker lost")
        return train_step()

    crashing.train_step = crash_before_step_2
    with pytest.raises(RuntimeError, match="worker lost"):
        crashing.fit()
    resumed = trainer(tmp_path / "crashed", "train.steps=3", "checkpoint.memory_every=1")
    assert resumed.fit()["losses"] == full["losses"][1:]
    assert "resumed from the memory snapshot of step 1 (no disk checkpoint yet" in capsys.readouterr().out
