"""What the training loop does for Transformer-XL's segment recurrence (``model.segment_memory``, Dai et al. 2019).

The data order is :class:`~xscale.data.StreamSampler`'s (``data.order=streams``): each global batch row reads the
next window of its own stream, and stays on its data-parallel rank and local row. The trainer keeps one
:class:`~xscale.models.segment_memory.SegmentMemory` for the rank, hands it to every forward in the step's context,
advances it after the step and resets it when the streams restart. The memory is per rank (its rows), so a
checkpoint stores each rank's as ``segment_memory/rank_N.pt``; it resumes only with the same layout (the memory
is not resharded: resume with the saved layout, or start the memory afresh at a stream restart).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xscale.config import Config, ConfigError
from xscale.data import GlobalSampler, PackedTextDataset, StreamSampler
from xscale.models.segment_memory import SegmentMemory
from xscale.parallel.model import Batch, ParallelModel
from xscale.runtime import StepContext
from xscale.train.checkpoint import CheckpointError, load_per_rank
from xscale.train.step import evaluation_loss

MEMORY_FILES = "segment_memory"  # the per-rank files' folder in a checkpoint
MEMORY_META_KEY = "segment_memory"


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


def memory_meta(layout: str, world_size: int, local_batch_size: int, micro_batch_size: int) -> dict[str, Any]:
    """What a saved memory must match to be resumed: the layout that cut the batch into the ranks' rows."""
    return {"layout": layout, "world_size": world_size, "local_batch_size": local_batch_size,
            "micro_batch_size": micro_batch_size}


def load_memory(memory: SegmentMemory, path: Path, meta: dict[str, Any], expected: dict[str, Any],
                device: Any) -> None:
    """This rank's saved memory, refused (with how to resume) when the checkpoint was written by another layout."""
    saved = meta.get(MEMORY_META_KEY)
    if saved is None:
        raise CheckpointError(f"{path} holds no segment memory (it was trained without model.segment_memory); "
                              "resume it with model.segment_memory=0, or start a new run (checkpoint.resume=none)")
    if saved != expected:
        raise CheckpointError(
            f"{path} holds the segment memory of layout '{saved['layout']}' ({saved['world_size']} processes, "
            f"{saved['local_batch_size']} rows each in microbatches of {saved['micro_batch_size']}), not of this "
            f"run's '{expected['layout']}' ({expected['world_size']} processes, {expected['local_batch_size']} rows "
            f"in microbatches of {expected['micro_batch_size']}): the memory is per rank and is not resharded; "
            "resume with the saved parallel.* settings, process count and train.micro_batch_size")
    state = load_per_rank(path, MEMORY_FILES)
    if state is None:
        raise CheckpointError(f"{path}/{MEMORY_FILES} lacks this rank's memory file; the checkpoint is incomplete")
    memory.load_state_dict(state, device)


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
