"""Perceiver (xscale/models/stacks/perceiver.py): the cross-attend block against softmax written out per latent and
head (outputs and gradients, padded inputs), padding that changes no class logit, a tiny classifier that learns, the
options refused."""

import math

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.stacks.perceiver import CrossAttend
from xscale.parallel.loss import model_loss_sum

VOCAB = 40
CLASSIFIER = ["model.family=encoder", "model.position=learned", "model.n_layers=2", "train.task=classify",
              "data.dataset=lra_retrieval", "model.vocab_size=272", "model.pooling=mean", "model.stack=perceiver",
              "model.max_seq_len=16", "train.seq_len=16"]



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

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


def _model() -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=2, pooling="mean",
                         stack=Component("perceiver", {"latents": 4, "heads": 2}))
    return build_model(config, seed=0)


def test_latents_are_the_sequence_the_blocks_run_on() -> None:
    model = _model()
    assert model.stack.latents.shape == (4, 16)
    seen = []
    model.stack.layers["0"].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    model(torch.randint(1, VOCAB, (3, 11)))
    assert seen[0][:2] == (3, 4)


def test_padding_changes_no_class_logit() -> None:
    model = _model().eval()
    tokens = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    junk = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.zeros(3, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        expected = model(tokens, padding_mask=torch.ones(3, 5, dtype=torch.bool))
        got = model(torch.cat([tokens, junk], dim=1), padding_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tiny_perceiver_classifier_learns() -> None:
    """Class = the first token's parity; AdamW steps on one batch bring the loss well down."""
    torch.manual_seed(0)
    model = _model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(1, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens[:, 0] % 2}
    losses = []
    for _ in range(16):
        loss = model_loss_sum(model, batch) / 16
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.family=decoder", "model.pooling=mean"], "Perceiver AR for decoding is not built"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.latents=32"], "exceeds model.max_seq_len=16"),
    (["model.stack.options.heads=3"], "must divide model.d_model"),
    (["model.position=rope"], "model.position=rope is refused"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*CLASSIFIER, *overrides])
