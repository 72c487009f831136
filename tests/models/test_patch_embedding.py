"""ViT's patch embedding (eq. 1) against hand-written references: the patches, the flatten+linear map as a strided
convolution, the class token leading them, and learned positions added before the first block."""

import torch
import torch.nn.functional as F

from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.models.patch_embedding import PatchEmbedding, patchify
from xscale.runtime import StepContext

B, C, SIZE, P, D = 2, 3, 8, 4, 16
PIXELS = torch.randn(B, C, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def _config(**overrides) -> ModelConfig:
    settings = dict(family="encoder", d_model=D, n_layers=1, n_heads=2, max_seq_len=5, position="learned",
                    num_classes=4, pooling="cls", input="patches", image_size=SIZE, image_channels=C, patch_size=P)
    return ModelConfig(**{**settings, **overrides})


def test_patches_are_row_major_each_flattened_channel_first():
    expected = torch.stack([PIXELS[:, :, row * P:(row + 1) * P, col * P:(col + 1) * P].reshape(B, C * P * P)
                            for row in range(SIZE // P) for col in range(SIZE // P)], dim=1)
    torch.testing.assert_close(patchify(PIXELS, P), expected, rtol=0, atol=0)


def test_flatten_and_project_is_a_strided_convolution():
    embedding = PatchEmbedding(_config())
    torch.nn.init.normal_(embedding.projection.weight)
    torch.nn.init.normal_(embedding.projection.bias)
    torch.nn.init.normal_(embedding.class_token)
    weight = embedding.projection.weight.reshape(D, C, P, P)
    convolved = F.conv2d(PIXELS, weight, embedding.projection.bias, stride=P).flatten(2).transpose(1, 2)
    out = embedding(PIXELS)
    assert out.shape == (B, 1 + (SIZE // P) ** 2, D)
    torch.testing.assert_close(out[:, 1:], convolved)
    torch.testing.assert_close(out[:, 0], embedding.class_token[0].expand(B, D), rtol=0, atol=0)


def test_the_first_block_reads_class_token_and_patches_plus_learned_positions():
    model = build_model(_config(), seed=0)
    with torch.no_grad():
        embedded = model._embed(PIXELS, model.stack, StepContext())
        expected = model.embedding(PIXELS) + model.stack.position.weight[:5]
    torch.testing.assert_close(embedded, expected)


def test_the_classifier_reads_the_class_token():
    """model.pooling=cls: changing the class token changes the logits; the patches' order matters only through it."""
    model = build_model(_config(), seed=0).eval()
    with torch.no_grad():
        logits = model(PIXELS)
        model.embedding.class_token.add_(1.0)
        moved = model(PIXELS)
    assert logits.shape == (B, 4) and not torch.allclose(logits, moved)
