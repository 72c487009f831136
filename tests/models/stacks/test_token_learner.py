"""TokenLearner (xscale/models/stacks/token_learner.py): eq. 1 against a loop over learned tokens and input tokens
(outputs and gradients), padding that changes no class logit, a tiny classifier that learns, the options and
layouts refused."""

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError
from xscale.models.stacks.token_learner import TokenLearner
from xscale.parallel.checks import resolve_dims


def loop_reference(learner: TokenLearner, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, length, _ = x.shape
    tokens = learner.maps.out_features
    out = []
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t]]
        rows = []
        for i in range(tokens):
            weights = [torch.sigmoid(learner.maps.weight[i] @ F.gelu(learner.hidden(learner.norm(x[b, t])))
                                     + learner.maps.bias[i]) for t in real]
            rows.append(sum(w * x[b, t] for w, t in zip(weights, real)) / len(real))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_matches_the_loop_reference() -> None:
    torch.manual_seed(0)
    learner = TokenLearner(8, 3).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = learner(x, mask)
    ref = loop_reference(learner, x, mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(learner(x), loop_reference(learner, x, torch.ones(2, 6, dtype=torch.bool)))
    grad = torch.randn_like(out)
    inputs = (x, *learner.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want)


TOKEN_LEARNER = Component("token_learner", {"tokens": 4, "after_layer": 1})


def test_padding_changes_no_class_logit(tiny_classifier) -> None:
    expected, got = tiny_classifier.padded_logits(tiny_classifier.model(TOKEN_LEARNER), 5, 6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tiny_token_learner_classifier_learns(tiny_classifier) -> None:
    """Class = the first token's parity; AdamW steps on one batch bring the loss well down."""
    losses = tiny_classifier.train(tiny_classifier.model(TOKEN_LEARNER), tiny_classifier.parity_batch(), 12, 16)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.pooling=mean"], "set model.family=encoder and train.task=classify"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.after_layer=2"], "1 <= after_layer < model.n_layers=2"),
    (["model.stack.options.tokens=32"], "exceeds model.max_seq_len=16"),
    (["model.position=rope"], "model.position=rope is refused"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message, tiny_classifier):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, tiny_classifier.overrides("token_learner", "model.stack.options.tokens=4",
                                                             *overrides))


@pytest.mark.parametrize("layout,message", [
    (["parallel.tp=2"], "parallel.tp=2 is not supported"),
    (["parallel.pp=2"], "parallel.pp=2 is not supported"),
])
def test_model_parallel_layouts_are_refused(layout, message, tiny_classifier):
    overrides = tiny_classifier.overrides("token_learner", "model.stack.options.tokens=4", *layout)
    with pytest.raises(ConfigError, match=message):
        resolve_dims(load_config_from_cli(None, overrides), 2)
