"""Perceiver (xscale/models/stacks/perceiver.py): the cross-attend block against softmax written out per latent and
head (outputs and gradients, padded inputs), padding that changes no class logit, a tiny classifier that learns, the
options refused."""

import math

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError
from xscale.models.stacks.perceiver import CrossAttend


def loop_reference(block: CrossAttend, latents: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, count, width = latents.shape
    head_dim = width // block.heads
    out = []
    for b in range(batch):
        keys = [block.input_norm(inputs[b, t]) for t in range(inputs.shape[1]) if mask[b, t]]
        rows = []
        for n in range(count):
            query = block.query(block.latent_norm(latents[b, n]))
            heads = []
            for h in range(block.heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                logits = torch.stack([query[part] @ block.key(key)[part] / math.sqrt(head_dim) for key in keys])
                weights = logits.softmax(0)
                heads.append(sum(w * block.value(key)[part] for w, key in zip(weights, keys)))
            z = latents[b, n] + block.out(torch.cat(heads))
            rows.append(z + block.mlp[2](F.gelu(block.mlp[0](block.mlp_norm(z)))))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_cross_attend_matches_the_loop_reference() -> None:
    torch.manual_seed(0)
    block = CrossAttend(8, 16, 2).double()
    latents = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    inputs = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = block(latents, inputs, mask)
    ref = loop_reference(block, latents, inputs, mask)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    wrt = (latents, inputs, *block.parameters())
    for got, want in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(got, want)


PERCEIVER = Component("perceiver", {"latents": 4, "heads": 2})


def test_latents_are_the_sequence_the_blocks_run_on(tiny_classifier) -> None:
    model = tiny_classifier.model(PERCEIVER)
    assert model.stack.latents.shape == (4, 16)
    seen = []
    model.stack.layers["0"].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    model(torch.randint(1, tiny_classifier.vocab, (3, 11)))
    assert seen[0][:2] == (3, 4)


def test_padding_changes_no_class_logit(tiny_classifier) -> None:
    expected, got = tiny_classifier.padded_logits(tiny_classifier.model(PERCEIVER), 5, 6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tiny_perceiver_classifier_learns(tiny_classifier) -> None:
    """Class = the first token's parity; AdamW steps on one batch bring the loss well down."""
    losses = tiny_classifier.train(tiny_classifier.model(PERCEIVER), tiny_classifier.parity_batch(), 16, 16)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.pooling=mean"],
     "set model.family=encoder and train.task=classify, or model.family=decoder and train.task=lm"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.latents=32"], "exceeds model.max_seq_len=16"),
    (["model.stack.options.heads=3"], "must divide model.d_model"),
    (["model.position=rope"], "model.position=rope is refused"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message, tiny_classifier):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, tiny_classifier.overrides("perceiver", *overrides))
