"""Map-style datasets over global sample indices: packed text windows and synthetic-task examples.

Sample ``i`` is a pure function of (data, seed, i): its random choices (MLM masks, T5 spans, task
examples) come from a generator seeded by (seed, global index), so any rank under any layout that
reads sample ``i`` gets the same tensors. Every sample is ``{"input_ids", "labels"}`` of fixed
shape, plus ``decoder_input_ids`` for encoder-decoder objectives.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import numpy as np
import torch

from xscale.data.objectives import IGNORE_INDEX, OBJECTIVES, Sample, TokenStream

WindowTransform = Callable[[torch.Tensor, torch.Generator], Sample]
# The objectives that also lay out the synthetic tasks' examples (layout_example): clm, mlm, span.
EXAMPLE_OBJECTIVES = tuple(name for name in OBJECTIVES.names() if not OBJECTIVES.get(name).text_only)


class ArrayTokens:
    """A token stream held in memory."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


def tokenize_documents(documents: Iterable[str], tokenizer, append_eos: bool = True) -> np.ndarray:
    """Encode documents into one int32 stream, each followed by eos (the separator packing relies on)."""
    pieces = []
    for document in documents:
        ids = tokenizer.encode(document)
        if append_eos:
            ids.append(tokenizer.eos_id)
        pieces.append(np.asarray(ids, dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A generator that depends only on (seed, global sample index)."""
    state = np.random.SeedSequence([seed, index]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_rng(seed: int, index: int) -> random.Random:
    """Python's RNG seeded by (seed, global sample index), for the task generators."""
    state = np.random.SeedSequence([seed, index]).generate_state(2, np.uint32)
    return random.Random(int(state[0]) << 32 | int(state[1]))


class PackedTextDataset(torch.utils.data.Dataset):
    """Windows ``[w*L, w*L + window_length)`` of the token stream, L = window_length - (1 for CLM's overlap).

    Windows ``first_window .. first_window + len(self) - 1`` belong to this split (train first, eval last).
    """

    def __init__(self, stream: TokenStream, window_length: int, transform: WindowTransform, seed: int,
                 stride: int | None = None, first_window: int = 0, num_windows: int | None = None) -> None:
        self.stream, self.window_length, self.transform, self.seed = stream, window_length, transform, seed
        self.stride = stride if stride is not None else window_length
        available = self.count_windows(len(stream), window_length, self.stride)
        self.first_window = first_window
        self.num_windows = available - first_window if num_windows is None else num_windows
        if self.num_windows <= 0 or first_window + self.num_windows > available:
            raise ValueError(f"the corpus has {len(stream)} tokens: {available} windows of {window_length}, "
                             f"too few for windows {first_window}..{first_window + self.num_windows - 1}; "
                             "use more text or a shorter train.seq_len")

    @staticmethod
    def count_windows(stream_length: int, window_length: int, stride: int) -> int:
        """How many whole windows a stream of ``stream_length`` tokens holds."""
        return max(0, (stream_length - window_length) // stride + 1)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"sample {index} out of range for {self.num_windows} samples")
        window = self.first_window + index
        start = window * self.stride
        tokens = torch.from_numpy(np.asarray(self.stream.read(start, start + self.window_length), dtype=np.int64))
        return self.transform(tokens, sample_generator(self.seed, window))


def layout_example(prompt: list[int], answer: list[int], objective: str, seq_len: int, vocab) -> Sample:
    """Lay a (prompt, answer) example out for an objective, left-padded so the answer ends the sequence.

    clm: the answer is predicted token by token after the prompt; mlm: the answer positions are <mask>
    in the input; span (encoder-decoder): the encoder reads the prompt, the decoder writes answer + eos.
    """
    if objective == "clm":
        sequence = prompt + answer
        inputs = sequence[:-1]
        labels = [IGNORE_INDEX] * (len(prompt) - 1) + answer
    elif objective == "mlm":
        inputs = prompt + [vocab.mask_id] * len(answer)
        labels = [IGNORE_INDEX] * len(prompt) + answer
    elif objective == "span":
        inputs = prompt
        labels = answer + [vocab.eos_id]
        return {"input_ids": _left_pad(inputs, seq_len, vocab.pad_id),
                "labels": torch.tensor(labels, dtype=torch.long),
                "decoder_input_ids": torch.tensor([vocab.pad_id] + labels[:-1], dtype=torch.long)}
    else:
        raise ValueError(f"objective '{objective}' is not one of {', '.join(EXAMPLE_OBJECTIVES)}")
    return {"input_ids": _left_pad(inputs, seq_len, vocab.pad_id), "labels": _left_pad(labels, seq_len, IGNORE_INDEX)}


def _left_pad(values: list[int], length: int, fill: int) -> torch.Tensor:
    if len(values) > length:
        raise ValueError(f"an example of {len(values)} tokens does not fit seq_len={length}")
    return torch.tensor([fill] * (length - len(values)) + values, dtype=torch.long)


class TaskDataset(torch.utils.data.Dataset):
    """``num_samples`` examples of a synthetic task; sample i uses the RNG of global index first_sample + i."""

    def __init__(self, task, objective: str, seq_len: int, seed: int, num_samples: int, first_sample: int = 0
                 ) -> None:
        if objective not in EXAMPLE_OBJECTIVES:
            raise ValueError(f"objective '{objective}' is not one of {', '.join(EXAMPLE_OBJECTIVES)}")
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.task, self.objective, self.seq_len, self.seed = task, objective, seq_len, seed
        self.num_samples, self.first_sample = num_samples, first_sample

    @property
    def vocab(self):
        return self.task.vocab

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        prompt, answer = self.task.example(sample_rng(self.seed, self.first_sample + index))
        return layout_example(prompt, answer, self.objective, self.seq_len, self.task.vocab)


def collate(samples: list[Sample]) -> Sample:
    """Stack samples of equal shapes into a batch."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
