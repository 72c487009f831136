"""A weighted blend of datasets (Megatron-LM's BlendedDataset), and the tokens each source has been trained on.

Sample ``i`` of the blend comes from the source whose realised share lags its weight most after samples
``0..i-1`` (megatron-core's ``build_blending_indices``: source ``argmax_d w_d * max(i, 1) - n_d(i)``), as its
``n_d(i)``-th sample (wrapping around a source that is shorter than its share). The map is a pure function of
the weights and ``i``, so every rank under every layout and every resume reads the same sample ``i``; the
training sampler's seeded shuffle orders the blend.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample, its index inside that source) for ``size`` samples, from megatron-core's helper."""
    # Imported here, as xscale.data.indexed does: importing megatron.core takes seconds, and only blends need it.
    try:
        with warnings.catch_warnings():  # megatron-core's notes on Transformer Engine and Apex: not used here
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers_cpp
    except ImportError as error:
        raise ImportError("blending data.sources needs megatron-core's compiled dataset helpers: pip install "
                          "megatron-core (in xscale's base install); from a source checkout run `make -C megatron/core/datasets`") from error
    normalised = np.asarray(weights, dtype=np.float64)
    normalised = normalised / normalised.sum()
    source_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(source_index, sample_index, normalised, len(normalised), size, False)
    return source_index, sample_index


@runtime_checkable
class HasSources(Protocol):
    """A dataset whose samples come from named sources (per-source token counts are logged for it)."""

    source_names: list[str]

    def sources_of(self, indices: Sequence[int]) -> np.ndarray: ...


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (see the module docstring)."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], names: Sequence[str], size: int) -> None:
        if not datasets or len(datasets) != len(weights) or len(datasets) != len(names):
            raise ValueError("BlendedDataset needs one weight and one name per dataset")
        if any(len(dataset) == 0 for dataset in datasets):
            raise ValueError("every blended dataset needs at least one sample")
        if size <= 0:
            raise ValueError(f"a blend needs a positive size, got {size}")
        self.datasets, self.weights, self.source_names = list(datasets), list(weights), list(names)
        self.source_index, self.sample_index = blending_indices(weights, size)

    def __len__(self) -> int:
        return len(self.source_index)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, sample inside the source) of blended sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        source = int(self.source_index[index])
        return source, int(self.sample_index[index]) % len(self.datasets[source])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, inner = self.locate(index)
        return self.datasets[source][inner]

    def sources_of(self, indices: Sequence[int]) -> np.ndarray:
        return self.source_index[np.asarray(indices, dtype=np.int64)]


class SourceTokenCounter:
    """Tokens trained on per source, over the global batch (the same on every rank); kept in checkpoints."""

    def __init__(self, names: Sequence[str], tokens_per_sample: int) -> None:
        self.names, self.tokens_per_sample = list(names), tokens_per_sample
        self.tokens = dict.fromkeys(self.names, 0)

    def count(self, sources: np.ndarray) -> None:
        """Add the samples of one global batch, given the source of each."""
        for source, samples in zip(*np.unique(sources, return_counts=True)):
            self.tokens[self.names[int(source)]] += int(samples) * self.tokens_per_sample

    def scalars(self) -> dict[str, float]:
        return {f"data/tokens/{name}": float(value) for name, value in self.tokens.items()}

    def state_dict(self) -> dict[str, int]:
        return dict(self.tokens)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved counts; a source the checkpoint did not know starts at 0."""
        self.tokens.update({name: int(value) for name, value in state.items() if name in self.tokens})
