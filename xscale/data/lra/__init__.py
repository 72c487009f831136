"""Long Range Arena-style classification tasks (Tay et al. 2021), generated procedurally and deterministically.

Each task turns a seeded ``random.Random`` into one example ``(tokens, label)`` over its :class:`FixedVocab`
(labels are class indices): ListOps (:class:`xscale.data.tasks.ListOpsTask`, the answer digit as the class), a
byte-level matching task standing in for LRA's AAN retrieval (:mod:`.retrieval`) and Pathfinder's dashed curves
(:mod:`.pathfinder`). Sample i of a split is a function of (seed, i) alone (``xscale.data.datasets.sample_rng``).

With ``pad_as_content`` the pad tokens are read like any other (no ``padding_mask``), as a fixed-length input:
attention kinds that take no key-padding mask can then learn the task too (``xscale bench lra`` compares every
kind this way, with the same input for each).
"""

from __future__ import annotations

import random

import torch

from xscale.data.datasets import sample_rng
from xscale.data.fixed_vocab import FixedVocab
from xscale.data.labeled import classification_sample
from xscale.data.lra.pathfinder import PathfinderTask
from xscale.data.lra.retrieval import RetrievalTask
from xscale.data.lra.shapes import ShapesTask
from xscale.data.tasks import ListOpsTask


class ListOpsClassification:
    """LRA ListOps as classification: the expression's tokens, its value (0-9) as the class."""

    num_classes = 10

    def __init__(self, seq_len: int, max_depth: int = 6, max_args: int = 5) -> None:
        self.task = ListOpsTask(seq_len, max_depth=max_depth, max_args=max_args)
        self.vocab: FixedVocab = self.task.vocab
        self.first_digit = self.vocab.ids["0"]

    def example(self, rng: random.Random) -> tuple[list[int], int]:
        prompt, answer = self.task.example(rng)
        return prompt, answer[0] - self.first_digit


PAD_AS_CONTENT = "pad_as_content"  # the data.dataset.options key: the model reads the pads (no padding mask)
LRA_TASKS = {"listops": ListOpsClassification, "retrieval": RetrievalTask, "pathfinder": PathfinderTask}


class GeneratedClassificationDataset(torch.utils.data.Dataset):
    """``num_samples`` examples of an LRA task; sample i uses the RNG of global index first_sample + i, led by
    ``class_token`` (if any) and padded to ``seq_len`` like :class:`xscale.data.labeled.ClassificationDataset`
    (with ``pad_as_content``: without the padding mask, so the model reads the pads)."""

    def __init__(self, task, seq_len: int, seed: int, num_samples: int, first_sample: int = 0,
                 class_token: int | None = None, pad_as_content: bool = False) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.task, self.seq_len, self.seed = task, seq_len, seed
        self.num_samples, self.first_sample, self.class_token = num_samples, first_sample, class_token
        self.pad_as_content = pad_as_content
        self.label_names = [str(index) for index in range(task.num_classes)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        tokens, label = self.task.example(sample_rng(self.seed, self.first_sample + index))
        lead = [] if self.class_token is None else [self.class_token]
        sample = classification_sample(lead + tokens, label, self.seq_len, self.task.vocab.pad_id)
        if self.pad_as_content:
            del sample["padding_mask"]
        return sample


class GeneratedImageDataset(torch.utils.data.Dataset):
    """``num_samples`` images of ``task`` (:class:`ShapesTask`): sample i is ``{"pixels": (C, H, W), "labels": ()}``
    from the RNG of global index first_sample + i; no padding (every image has one shape)."""

    def __init__(self, task: ShapesTask, seed: int, num_samples: int, first_sample: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.task, self.seed, self.num_samples, self.first_sample = task, seed, num_samples, first_sample
        self.label_names = list(task.label_names)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        pixels, label = self.task.example(sample_rng(self.seed, self.first_sample + index))
        return {"pixels": pixels, "labels": torch.tensor(label, dtype=torch.long)}


__all__ = ["LRA_TASKS", "PAD_AS_CONTENT", "GeneratedClassificationDataset", "GeneratedImageDataset", "ListOpsClassification",
           "PathfinderTask", "RetrievalTask", "ShapesTask"]
