"""A data sampler defined over global sample indices, so its state survives a change of data-parallel degree.

Position p in the training stream (p = 0, 1, 2, ... over all epochs) reads sample
``permutation_e[p mod N]`` with epoch e = p // N and a permutation seeded by (seed, e). Step s reads
positions ``origin + s*B .. origin + (s+1)*B - 1`` (B the global batch). When a step runs k microbatches per
step the batch is cut into k contiguous slices and data-parallel rank r of D takes the r-th contiguous piece
of each, so microbatch m of all ranks together is the m-th slice (k = 1: rank r takes the r-th slice); an
expert-parallel routing group is then a contiguous run of samples (:mod:`xscale.parallel.model`). The state
holds only global quantities (seed, samples consumed, step), so resuming with any number of ranks continues
with exactly the samples not yet seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class GlobalSampler:
    """Epoch-wise shuffled global sample indices, batched globally and sharded by data-parallel rank."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.origin = 0  # stream position of step 0 (non-zero after resuming with another global batch)
        self.next_step = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the sample indices in ``epoch``."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        if self.shuffle:
            state = np.random.SeedSequence([self.seed, epoch]).generate_state(2, np.uint32)
            generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
            order = torch.randperm(self.num_samples, generator=generator).numpy()
        else:
            order = np.arange(self.num_samples)
        self._epoch_cache = (epoch, order)
        return order

    def indices_at(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions ``start .. start + count - 1`` (crossing epochs as needed)."""
        indices: list[int] = []
        position = start
        while len(indices) < count:
            epoch, offset = divmod(position, self.num_samples)
            take = min(count - len(indices), self.num_samples - offset)
            indices.extend(int(i) for i in self.permutation(epoch)[offset:offset + take])
            position += take
        return indices

    def batch_indices(self, step: int) -> list[int]:
        """The whole global batch of ``step``; records that the samples up to this batch are consumed."""
        indices = self.step_indices(step)
        self.next_step = max(self.next_step, step + 1)
        return indices

    def step_indices(self, step: int) -> list[int]:
        """The whole global batch of ``step``, recording nothing (what a loader reads ahead)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return self.indices_at(self.origin + step * self.global_batch_size, self.global_batch_size)

    @staticmethod
    def shard(indices: list[int], dp_rank: int, dp_size: int, microbatches: int = 1) -> list[int]:
        """What data-parallel rank ``dp_rank`` of ``dp_size`` reads of a global batch: its piece of each of the
        ``microbatches`` contiguous slices, in microbatch order."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_size})")
        if len(indices) % dp_size:
            raise ValueError(f"a global batch of {len(indices)} samples does not split over {dp_size} "
                             "data-parallel ranks; make train.global_batch_size a multiple of the data-parallel size")
        per_rank = len(indices) // dp_size
        if microbatches < 1 or per_rank % microbatches:
            raise ValueError(f"a rank's {per_rank} samples do not split into {microbatches} microbatches")
        micro = per_rank // microbatches
        return [index for slice_start in range(dp_rank * micro, len(indices), dp_size * micro)
                for index in indices[slice_start:slice_start + micro]]

    @property
    def consumed_samples(self) -> int:
        return self.origin + self.next_step * self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_samples": self.num_samples, "shuffle": self.shuffle,
                "consumed_samples": self.consumed_samples, "epoch": self.epoch, "step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved step; a changed global batch size keeps the stream position exact."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"the checkpoint's sampler covered {state['num_samples']} samples but this dataset has "
                             f"{self.num_samples}; resume with the same data")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._epoch_cache = None
        self.next_step = int(state["step"])
        self.origin = int(state["consumed_samples"]) - self.next_step * self.global_batch_size


class StreamSampler(GlobalSampler):
    """Transformer-XL's data order (Dai et al. 2019): the windows cut into B = global batch streams of
    L = N // B consecutive windows; row b of step s reads window b * L + s mod L.

    Row b is the same global row at every step, so :meth:`GlobalSampler.shard` keeps each stream on its
    data-parallel rank and local row, and a model carrying a memory from step to step (``model.segment_memory``)
    reads the next segment of the same text. Every L steps all streams restart at their first window
    (:meth:`starts_streams`); the N mod B windows left over are never read.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        super().__init__(num_samples, global_batch_size, seed, shuffle=False)
        self.stream_length = num_samples // global_batch_size
        if self.stream_length == 0:
            raise ValueError(f"data.order=streams cuts {num_samples} windows into train.global_batch_size="
                             f"{global_batch_size} streams: too few windows; use more text or a smaller batch")

    def step_indices(self, step: int) -> list[int]:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        offset = step % self.stream_length
        return [row * self.stream_length + offset for row in range(self.global_batch_size)]

    def starts_streams(self, step: int) -> bool:
        """Whether ``step`` reads the first window of every stream (a memory carried so far must be dropped)."""
        return step % self.stream_length == 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "order": "streams", "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved step; the streams are those of the same global batch size."""
        if state.get("order") != "streams" or int(state.get("global_batch_size", -1)) != self.global_batch_size:
            raise ValueError(f"the checkpoint's data order is {state.get('order', 'shuffled')} over global batches "
                             f"of {state.get('global_batch_size', '?')}; data.order=streams resumes only with the "
                             f"same streams: keep data.order=streams and train.global_batch_size="
                             f"{state.get('global_batch_size', '?')}")
        super().load_state_dict(state)
        self.origin = 0
