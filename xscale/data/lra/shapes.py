"""A procedural image task for patch-embedding classifiers (``data.dataset=images_shapes``, ``model.input=patches``).

Each image holds one filled shape, circle, square, triangle or cross (the class, drawn uniformly), at a random
position and size, in a random colour on a darker random background, plus Gaussian pixel noise. Images are float
tensors (C, H, W) in about [0, 1]; sample i of a split is a function of (seed, i) alone
(``xscale.data.datasets.sample_rng``), like the LRA generators beside it. No download: the ViT paper's ImageNet
stands in for a task a tiny model learns in seconds on a CPU.
"""

from __future__ import annotations

import random

import torch

SHAPES = ("circle", "square", "triangle", "cross")


def shape_mask(shape: str, size: int, center: tuple[float, float], radius: float) -> torch.Tensor:
    """(size, size) bool: the pixels whose centres fall inside ``shape`` of half-width ``radius`` at ``center``
    (row, column)."""
    rows = torch.arange(size, dtype=torch.float32).unsqueeze(1) - center[0]
    cols = torch.arange(size, dtype=torch.float32).unsqueeze(0) - center[1]
    if shape == "circle":
        return rows**2 + cols**2 <= radius**2
    if shape == "square":
        return (rows.abs() <= radius) & (cols.abs() <= radius)
    if shape == "triangle":  # apex up, base at the bottom: the half-width grows from 0 to radius down the rows
        return (rows.abs() <= radius) & (cols.abs() <= (rows + radius) / 2)
    if shape == "cross":
        arm = radius / 3
        return ((rows.abs() <= radius) & (cols.abs() <= arm)) | ((cols.abs() <= radius) & (rows.abs() <= arm))
    raise ValueError(f"shape '{shape}' is not one of {', '.join(SHAPES)}")


class ShapesTask:
    """``channels`` x ``size`` x ``size`` images of one shape each; the class is the shape's index in SHAPES."""

    num_classes = len(SHAPES)
    label_names = list(SHAPES)

    def __init__(self, size: int, channels: int, noise: float = 0.1) -> None:
        if size < 8 or channels < 1 or noise < 0:
            raise ValueError(f"images_shapes needs images of at least 8x8 pixels, channels >= 1 and noise >= 0 "
                             f"(got size={size}, channels={channels}, noise={noise})")
        self.size, self.channels, self.noise = size, channels, noise

    def example(self, rng: random.Random) -> tuple[torch.Tensor, int]:
        label = rng.randrange(self.num_classes)
        radius = rng.uniform(self.size / 4, self.size * 0.4)
        center = (rng.uniform(radius, self.size - 1 - radius), rng.uniform(radius, self.size - 1 - radius))
        foreground = torch.tensor([rng.uniform(0.5, 1.0) for _ in range(self.channels)]).view(-1, 1, 1)
        background = torch.tensor([rng.uniform(0.0, 0.3) for _ in range(self.channels)]).view(-1, 1, 1)
        inside = shape_mask(SHAPES[label], self.size, center, radius)
        pixels = torch.where(inside, foreground, background)
        noise = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(rng.getrandbits(62)))
        return pixels + self.noise * noise, label
