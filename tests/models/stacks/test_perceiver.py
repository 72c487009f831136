"""Perceiver (xscale/models/stacks/perceiver.py): the cross-attend block against softmax written out per latent and
head (outputs and gradients, padded inputs), padding that changes no class logit, a tiny classifier that learns, the
options refused. Perceiver AR: the causal cross-attend against a loop over positions (outputs and gradients), no
logit moved by a later token, the loss read on the last N positions only (and the labelled-token count with it), a
tiny language model that learns, decoding by recomputation, the layouts refused by name, and (slow) ZeRO-3 data
parallelism at one-process parity."""

import math

import pytest
import torch
import torch.nn.functional as F
from parity_models import DECODER, DROPOUT, assert_parity

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.generation.decode import decodes_with_cache, generate
from xscale.models import build_model
from xscale.models.stacks import label_loss_positions
from xscale.models.stacks.perceiver import CrossAttend
from xscale.parallel.checks import resolve_dims
from xscale.parallel.loss import model_loss_sum


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


def causal_loop_reference(block: CrossAttend, latents: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Perceiver AR's cross-attend, one latent at a time: latent i is input position M - N + i and reads inputs
    0..M - N + i."""
    batch, count, width = latents.shape
    length, head_dim = inputs.shape[1], width // block.heads
    out = []
    for b in range(batch):
        rows = []
        for i in range(count):
            keys = [block.input_norm(inputs[b, t]) for t in range(length - count + i + 1)]
            query = block.query(block.latent_norm(latents[b, i]))
            heads = []
            for h in range(block.heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                logits = torch.stack([query[part] @ block.key(key)[part] / math.sqrt(head_dim) for key in keys])
                heads.append(sum(w * block.value(key)[part] for w, key in zip(logits.softmax(0), keys)))
            z = latents[b, i] + block.out(torch.cat(heads))
            rows.append(z + block.mlp[2](F.gelu(block.mlp[0](block.mlp_norm(z)))))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_causal_cross_attend_matches_the_loop_over_positions() -> None:
    torch.manual_seed(0)
    block = CrossAttend(8, 16, 2).double()
    inputs = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    latents = inputs[:, -3:]
    out = block(latents, inputs, None, causal=True)
    ref = causal_loop_reference(block, latents, inputs)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    wrt = (inputs, *block.parameters())
    for got, want in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(got, want)


def _perceiver_ar(latents: int = 4) -> torch.nn.Module:
    config = ModelConfig(family="decoder", vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position="learned", stack=Component("perceiver", {"latents": latents, "heads": 2}))
    return build_model(config, seed=0)


def test_perceiver_ar_logits_are_the_last_positions_and_no_later_token_moves_them() -> None:
    model = _perceiver_ar().eval()
    tokens = torch.randint(1, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 4, 40)  # positions 6..9
        for changed in range(10):
            edited = tokens.clone()
            edited[:, changed] = edited[:, changed] % 39 + 1
            moved = (model(edited) - logits).abs().amax(dim=(0, 2)) > 1e-6
            # latent i is position 6 + i: moved exactly when the changed token is at or before it
            assert moved.tolist() == [changed <= 6 + i for i in range(4)], (changed, moved)


def test_perceiver_ar_loss_reads_the_last_positions_and_counts_their_labels() -> None:
    model = _perceiver_ar().eval()
    window = torch.randint(1, 40, (2, 11), generator=torch.Generator().manual_seed(0))
    batch = label_loss_positions(model.config, {"input_ids": window[:, :-1], "labels": window[:, 1:]})
    assert (batch["labels"][:, :6] == -100).all() and (batch["labels"][:, 6:] == window[:, 7:]).all()
    with torch.no_grad():
        expected = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), window[:, 7:].flatten(), reduction="sum")
        torch.testing.assert_close(model_loss_sum(model, batch), expected)
    plain = {"input_ids": window[:, :-1], "labels": window[:, 1:]}
    assert label_loss_positions(ModelConfig(), plain) is plain


def test_a_tiny_perceiver_ar_language_model_learns() -> None:
    """Next token = the current one + 1 (mod 39); AdamW steps on one batch bring the loss well down."""
    torch.manual_seed(0)
    model = _perceiver_ar().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = torch.randint(1, 40, (16, 1), generator=torch.Generator().manual_seed(0))
    window = (start + torch.arange(13)) % 39 + 1
    batch = label_loss_positions(model.config, {"input_ids": window[:, :-1], "labels": window[:, 1:]})
    losses = []
    for _ in range(20):
        loss = model_loss_sum(model, batch) / int((batch["labels"] != -100).sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_perceiver_ar_decodes_by_recomputing_the_prefix() -> None:
    model = _perceiver_ar()
    assert not decodes_with_cache(model)
    prompt = torch.randint(1, 40, (2, 3), generator=torch.Generator().manual_seed(0))
    generated = generate(model, prompt, 5)
    sequence = torch.cat([prompt, generated.tokens], dim=1)
    with torch.no_grad():
        for step in range(5):
            torch.testing.assert_close(generated.logits[:, step], model(sequence[:, :3 + step])[:, -1].float())


AR = ["model.position=learned", "model.max_seq_len=16", "model.stack=perceiver", "model.stack.options.latents=8"]


@pytest.mark.parametrize("layout,message", [
    (["parallel.tp=2"], "parallel.tp=2 is refused with model.stack=perceiver: its cross-attention"),
    (["parallel.pp=2"], "parallel.pp=2 is refused with model.stack=perceiver: the latent array"),
    (["parallel.cp=2"], "parallel.cp=2 is refused with model.stack=perceiver: the cross-attention reads"),
])
def test_perceiver_ar_refuses_model_parallel_layouts(layout, message):
    with pytest.raises(ConfigError, match=message):
        resolve_dims(load_config_from_cli(None, [*DECODER, *AR, *layout]), 2)


@pytest.mark.slow
def test_perceiver_ar_under_zero3_data_parallel_matches_one_process(tmp_path):
    assert_parity([*DECODER, *DROPOUT, *AR], ["dp_shard=2,zero_stage=3"], tmp_path, same_grad_norms=True)
