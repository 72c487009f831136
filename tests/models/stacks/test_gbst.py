"""Charformer's GBST (xscale/models/stacks/gbst.py): sec. 2.1 position by position and block size by block size
(outputs and gradients, with and without calibration, padded), padding that changes no class logit, a tiny byte
classifier and a byte MLM encoder that learn, the options refused."""

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError
from xscale.models.stacks.gbst import GBSTOptions, GradientBasedSubwordTokenization


def loop_reference(gbst: GradientBasedSubwordTokenization, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, length, _ = x.shape
    out = []
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t]]
        blocks = {}
        for size in range(1, gbst.max_block_size + 1):
            for i in range(length):
                start = i // size * size
                rows = [t for t in range(start, min(start + size, length)) if t in real]
                blocks[size, i] = sum(x[b, t] for t in rows) / max(len(rows), 1) if rows else x.new_zeros(x.shape[-1])
        sizes = range(1, gbst.max_block_size + 1)
        probs = [torch.stack([gbst.score(blocks[s, i])[0] for s in sizes]).softmax(0) for i in range(length)]
        if gbst.calibration:
            calibrated = []
            for i in range(length):
                affinity = torch.stack([probs[i] @ probs[j] for j in real]).softmax(0)
                calibrated.append(sum(a * probs[j] for a, j in zip(affinity, real)))
            probs = calibrated
        latent = [sum(probs[i][s - 1] * blocks[s, i] for s in sizes) for i in range(length)]
        pooled = []
        for start in range(0, length, gbst.downsample_rate):
            rows = [t for t in range(start, min(start + gbst.downsample_rate, length)) if t in real]
            pooled.append(sum(latent[t] for t in rows) / len(rows) if rows else x.new_zeros(x.shape[-1]))
        out.append(torch.stack(pooled))
    return torch.stack(out)


@pytest.mark.parametrize("calibration", [True, False], ids=["calibrated", "plain"])
def test_matches_the_loop_reference(calibration: bool) -> None:
    torch.manual_seed(0)
    gbst = GradientBasedSubwordTokenization(6, GBSTOptions(max_block_size=3, downsample_rate=2,
                                                           calibration=calibration)).double()
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out, pooled_mask = gbst(x, mask)
    ref = loop_reference(gbst, x, mask)
    assert pooled_mask.tolist() == [[True] * 4, [True, True, False, False]]
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    inputs = (x, *gbst.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want)


def _gbst(downsample_rate: int) -> Component:
    return Component("gbst", {"max_block_size": 3, "downsample_rate": downsample_rate})


def test_padding_changes_no_class_logit(tiny_classifier) -> None:
    expected, got = tiny_classifier.padded_logits(tiny_classifier.model(_gbst(2)), 6, 6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_classes,downsample_rate", [(2, 2), (0, 1)], ids=["classifier", "mlm"])
def test_a_tiny_byte_model_learns(num_classes: int, downsample_rate: int, tiny_classifier) -> None:
    """Classifier: the first byte's parity; MLM (no downsampling): the input bytes back; one batch, AdamW."""
    model = tiny_classifier.model(_gbst(downsample_rate), num_classes=num_classes)
    batch = tiny_classifier.parity_batch(labels_are_tokens=not num_classes)
    losses = tiny_classifier.train(model, batch, 16, batch["input_ids"].numel())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.pooling=mean"], "set it to 1 or train.task=classify"),
    (["train.task=lm", "model.family=decoder", "model.stack.options.downsample_rate=1"], "set model.family=encoder"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.max_block_size=0"], "must be >= 1"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message, tiny_classifier):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, tiny_classifier.overrides("gbst", *overrides))
