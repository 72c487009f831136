"""ViT's patch embedding (Dosovitskiy et al. 2021, sec. 3.1, eq. 1): an image read as a sequence of patches.

z_0 = [x_class; x_p^1 E; x_p^2 E; ...; x_p^N E] + E_pos. The (C, H, W) image is cut into N = HW / P^2 patches of
P x P pixels, each flattened channel-first to a vector x_p^i of C P^2 values and projected by E (C P^2 -> D); a
learned class token x_class leads them, and its final hidden state feeds the classifier (``model.pooling=cls``).
E_pos is the stack's position encoding (``model.position=learned``: ViT's learned 1-D positions), added by the
Transformer after this module as it is for tokens. Flatten-then-project is the same map as a convolution with
kernel and stride P whose weight is E reshaped to (D, C, P, P).
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C * P * P): patches in row-major order, each flattened channel first, then rows, then
    columns (the layout of a (D, C, P, P) convolution weight)."""
    batch, channels, height, width = pixels.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"a {height}x{width} image does not split into {patch_size}x{patch_size} patches")
    rows, cols = height // patch_size, width // patch_size
    patches = pixels.reshape(batch, channels, rows, patch_size, cols, patch_size)
    patches = patches.permute(0, 2, 4, 1, 3, 5)  # (B, rows, cols, C, P, P)
    return patches.reshape(batch, rows * cols, channels * patch_size * patch_size)


def patch_count(config: ModelConfig) -> int:
    """N = (image_size / patch_size)^2 patches per image."""
    return (config.image_size // config.patch_size) ** 2


class PatchEmbedding(nn.Module):
    """Pixels (B, C, H, W) -> (B, 1 + N, D): the class token, then each patch's projection x_p E (eq. 1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.projection = nn.Linear(config.image_channels * config.patch_size ** 2, config.d_model)
        self.class_token = nn.Parameter(torch.empty(1, 1, config.d_model))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() != 4 or not pixels.is_floating_point():
            raise ValueError(f"model.input=patches reads float images (B, C, H, W), got a {pixels.dtype} tensor of "
                             f"shape {tuple(pixels.shape)}")
        patches = self.projection(patchify(pixels.to(self.projection.weight.dtype), self.patch_size))
        return torch.cat([self.class_token.expand(patches.shape[0], -1, -1), patches], dim=1)


def check_patch_config(config: Config) -> None:
    """model.input=patches reads the images of data.dataset=images_shapes for train.task=classify (an encoder), one
    position per patch plus the class token (train.seq_len), and no token ids (hash routing needs them)."""
    model, seq_len = config.model, config.train.seq_len
    patches = model.input == "patches"
    if patches != (config.data.dataset.kind == "images_shapes"):
        raise ConfigError("data.dataset=images_shapes (images) and model.input=patches go together: set both, or "
                          f"neither (got data.dataset={config.data.dataset}, model.input={model.input})")
    if not patches:
        return
    if config.train.task != "classify":
        raise ConfigError("model.input=patches classifies images: set train.task=classify and model.family=encoder")
    if model.image_size % model.patch_size:
        raise ConfigError(f"model.patch_size={model.patch_size} does not divide model.image_size={model.image_size}")
    expected = patch_count(model) + 1
    if seq_len != expected:
        raise ConfigError(f"train.seq_len={seq_len} must be the patch count plus the class token, "
                          f"(image_size / patch_size)^2 + 1 = {expected}: set train.seq_len={expected}")
    if model.moe.num_experts and model.moe.router.kind == "hash":
        raise ConfigError("model.moe.router=hash routes by token id and images have none (model.input=patches); "
                          "use another router")
