"""TokenLearner (xscale/models/stacks/token_learner.py): eq. 1 against a loop over learned tokens and input tokens
(outputs and gradients), padding that changes no class logit, a tiny classifier that learns, the options and
layouts refused."""

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.stacks.token_learner import TokenLearner
from xscale.parallel.checks import resolve_dims
from xscale.parallel.loss import model_loss_sum

VOCAB = 40
CLASSIFIER = ["model.family=encoder", "model.position=learned", "model.n_layers=2", "train.task=classify",
              "data.dataset=lra_retrieval", "model.vocab_size=272", "model.pooling=mean", "model.stack=token_learner",
              "model.stack.options.tokens=4", "model.max_seq_len=16", "train.seq_len=16"]



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

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


def _model(num_classes: int = 2, tokens: int = 4) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=num_classes, pooling="mean",
                         stack=Component("token_learner", {"tokens": tokens, "after_layer": 1}))
    return build_model(config, seed=0)


def test_padding_changes_no_class_logit() -> None:
    model = _model().eval()
    tokens = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    junk = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.zeros(3, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        expected = model(tokens, padding_mask=torch.ones(3, 5, dtype=torch.bool))
        got = model(torch.cat([tokens, junk], dim=1), padding_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_tiny_token_learner_classifier_learns() -> None:
    """Class = the first token's parity; AdamW steps on one batch bring the loss well down."""
    torch.manual_seed(0)
    model = _model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(1, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens[:, 0] % 2}
    losses = []
    for _ in range(12):
        loss = model_loss_sum(model, batch) / 16
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.pooling=mean"], "set model.family=encoder and train.task=classify"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.after_layer=2"], "1 <= after_layer < model.n_layers=2"),
    (["model.stack.options.tokens=32"], "exceeds model.max_seq_len=16"),
    (["model.position=rope"], "model.position=rope is refused"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*CLASSIFIER, *overrides])


@pytest.mark.parametrize("layout,message", [
    (["parallel.tp=2"], "parallel.tp=2 is not supported"),
    (["parallel.pp=2"], "parallel.pp=2 is not supported"),
])
def test_model_parallel_layouts_are_refused(layout, message):
    with pytest.raises(ConfigError, match=message):
        resolve_dims(load_config_from_cli(None, [*CLASSIFIER, *layout]), 2)
