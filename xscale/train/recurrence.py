"""What the training loop does for Transformer-XL's segment recurrence (``model.segment_memory``, Dai et al. 2019).

The data order is :class:`~xscale.data.StreamSampler`'s (``data.order=streams``): each global batch row reads the
next window of its own stream, and stays on its data-parallel rank and local row. The trainer keeps one
:class:`~xscale.models.segment_memory.SegmentMemory` for the rank, hands it to every forward in the step's context,
advances it after the step and resets it when the streams restart. The memory is per rank (its rows), so a
checkpoint stores each rank's as ``segment_memory/rank_N.pt``; a resume reads every saved rank's and regroups it for
its own rows (:mod:`~xscale.train.memory_reshard`), so it reshards with the checkpoint to another process count,
dp/tp/ZeRO layout or ``train.micro_batch_size``; another ``train.global_batch_size`` or model is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xscale.checkpoint.checkpointer import CheckpointError, load_per_rank, per_rank_file
from xscale.config.schema import Config, ConfigError
from xscale.data import GlobalSampler, PackedTextDataset, StreamSampler
from xscale.models.segment_memory import SegmentMemory
from xscale.parallel.model import Batch, ParallelModel
from xscale.runtime import StepContext
from xscale.train.memory_reshard import MemoryRows, StreamMemory
from xscale.train.step import evaluation_loss

MEMORY_FILES = "segment_memory"  # the per-rank files' folder in a checkpoint
MEMORY_META_KEY = "segment_memory"
LAYOUT_FIELDS = ("layout", "world_size", "local_batch_size", "micro_batch_size")  # a resume regroups for others
# What a resume cannot regroup the memory for: other streams, another model (absent from older checkpoints).
MODEL_FIELDS = ("train.global_batch_size", "model.n_layers", "model.d_model", "model.segment_memory",
                "model.compressed_memory")


def build_sampler(config: Config, dataset: Any) -> GlobalSampler:
    """data.order: shuffled (the default) or streams (consecutive windows of a long token stream per row)."""
    train = config.train
    if config.data.order != "streams":
        return GlobalSampler(len(dataset), train.global_batch_size, seed=train.seed)
    if not isinstance(dataset, PackedTextDataset):
        raise ConfigError(f"data.order=streams reads consecutive windows of one token stream, which "
                          f"data.dataset={config.data.dataset} (or a blend of data.sources) does not give; use "
                          "data.dataset=stdlib_text, text or indexed")
    try:
        return StreamSampler(len(dataset), train.global_batch_size, seed=train.seed)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def memory_meta(config: Config, layout: str, world_size: int, local_batch_size: int,
                micro_batch_size: int) -> dict[str, Any]:
    """What a saved memory must match to be resumed (MODEL_FIELDS), and the layout that cut the batch into the
    ranks' rows (LAYOUT_FIELDS, regrouped when they differ)."""
    model = config.model
    return {"layout": layout, "world_size": world_size, "local_batch_size": local_batch_size,
            "micro_batch_size": micro_batch_size, "train.global_batch_size": config.train.global_batch_size,
            "model.n_layers": model.n_layers, "model.d_model": model.d_model,
            "model.segment_memory": model.segment_memory, "model.compressed_memory": model.compressed_memory}


def load_memory(memory: SegmentMemory, path: Path, meta: dict[str, Any], expected: dict[str, Any],
                rows: MemoryRows, device: Any) -> str | None:
    """This rank's memory (``rows``) regrouped from every saved rank's; refused (with what to change) when the
    streams or the model differ. Returns what was regrouped when the saved layout differs from this run's."""
    saved = meta.get(MEMORY_META_KEY)
    if saved is None:
        raise CheckpointError(f"{path} holds no segment memory (it was trained without model.segment_memory); "
                              "resume it with model.segment_memory=0, or start a new run (checkpoint.resume=none)")
    changed = [f"{name}={saved[name]} (this run: {expected[name]})" for name in MODEL_FIELDS
               if name in saved and saved[name] != expected[name]]
    if changed:
        raise CheckpointError(f"{path} holds the segment memory of {', '.join(changed)}: it cannot be regrouped for "
                              "other streams or another model; resume with the saved values, or start a new run "
                              "(checkpoint.resume=none)")
    states = [load_per_rank(path, MEMORY_FILES, rank, mmap=True) for rank in range(int(saved["world_size"]))]
    missing = [per_rank_file(path, MEMORY_FILES, rank).name for rank, state in enumerate(states) if state is None]
    if missing:
        raise CheckpointError(f"{path}/{MEMORY_FILES} lacks {', '.join(missing[:4])} of the {len(states)} ranks that "
                              "saved it: the checkpoint is incomplete; resume from another one")
    streams = StreamMemory(states, expected["train.global_batch_size"])
    streams.check_model(expected["model.n_layers"], expected["model.d_model"], expected["model.segment_memory"],
                        expected["model.compressed_memory"])
    memory.load_state_dict(streams.cut(rows), device)
    if all(saved[name] == expected[name] for name in LAYOUT_FIELDS):
        return None
    return f"regrouped the segment memory of {_describe(saved)} for {_describe(expected)}"


def _describe(layout: dict[str, Any]) -> str:
    return (f"'{layout['layout']}' ({layout['world_size']} processes, {layout['local_batch_size']} rows each in "
            f"microbatches of {layout['micro_batch_size']})")


def stream_evaluation(model: ParallelModel, load: Callable[[list[int]], Batch], num_windows: int, batch_size: int,
                      segments: int, memory_length: int, context: StepContext,
                      compressed_length: int = 0) -> dict[str, float]:
    """Walk ``batch_size`` streams of the eval windows segment by segment (up to ``segments``): the mean token
    loss with the memory carried (eval/loss_memory) and, on the same windows, without it (eval/loss_no_memory)."""
    streams = num_windows // batch_size
    if streams == 0:
        return {"eval/loss_memory": math.nan, "eval/loss_no_memory": math.nan}
    memory = SegmentMemory(memory_length, compressed_length)
    with_memory, without = [], []
    for step in range(min(streams, segments)):
        batch = load([row * streams + step for row in range(batch_size)])
        without.append(float(evaluation_loss(model, batch, context)))
        with_memory.append(float(evaluation_loss(model, batch, context.with_segment_memory(memory))))
        memory.advance()
    return {"eval/loss_memory": sum(with_memory) / len(with_memory),
            "eval/loss_no_memory": sum(without) / len(without)}
