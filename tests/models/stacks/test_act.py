"""Universal Transformer + ACT: the halting loop against a per-position reference written from Graves (2016)."""

from __future__ import annotations

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.runtime import StepContext
from xscale.train.training_step import begin_training_step

UT = dict(vocab_size=64, d_model=16, n_layers=4, n_heads=2, max_seq_len=16, dropout=0.1, share_layers=True,
          stack=Component("act", {"threshold": 0.9, "ponder_cost": 0.05}))


def _reference(stack, x: torch.Tensor, context: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rho) position by position: halt at the first n with sum p >= threshold (or at N), y = sum p h + R h."""
    block, halting, threshold = stack.layers["0"], stack.act.halting, stack.act.threshold
    states, h = [], x
    for depth in range(stack.n_layers):
        h = block(h, stack.position, None, context=context.at_depth(depth))
        states.append(h)
    probabilities = [torch.sigmoid(halting(state)).squeeze(-1) for state in states]
    outputs, ponders = [], []
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            total, y = x.new_zeros(()), x.new_zeros(x.shape[-1])
            for n, (state, p) in enumerate(zip(states, probabilities)):
                if total + p[b, t] >= threshold or n == len(states) - 1:
                    remainder = 1 - total
                    outputs.append(y + remainder * state[b, t])
                    ponders.append(n + 1 + remainder)
                    break
                y, total = y + p[b, t] * state[b, t], total + p[b, t]
    return torch.stack(outputs).view_as(x), torch.stack(ponders)


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else param.grad.clone()


def _stack():
    torch.manual_seed(0)
    stack = build_model(ModelConfig(**UT)).stack.train()
    with torch.no_grad():  # halting probabilities spread over (0, 1): positions halt after different steps
        stack.act.halting.weight.normal_(0, 1.0)
        stack.act.halting.bias.fill_(-0.5)
    return stack


@pytest.mark.parametrize("context", [StepContext(seed=5, step=1), StepContext(seed=9)], ids=["seed5", "seed9"])
def test_outputs_ponder_cost_and_gradients_match_the_reference(context):
    stack, x = _stack(), torch.randn(2, 8, 16)
    weights = torch.linspace(-1, 1, x.numel()).view_as(x)
    y, rho = _reference(stack, x, context)
    assert len(set(rho.floor().tolist())) > 1, "positions should halt after different numbers of steps"
    (expected_loss := (y * weights).sum() + UT["stack"].options["ponder_cost"] * rho.mean()).backward()
    expected = {name: _grad(p) for name, p in stack.named_parameters()}
    stack.zero_grad(set_to_none=True)

    got = stack(x, None, None, context)[0]
    torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stack.act.ponder_mean, rho.mean().detach())
    (got * weights).sum().backward()  # the ponder cost reaches the gradients through the attached loss
    assert expected_loss.isfinite()
    for name, param in stack.named_parameters():
        torch.testing.assert_close(_grad(param), expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert expected["act.halting.bias"].abs() > 0


def test_step_shares_the_ponder_cost_over_its_forwards():
    stack, x = _stack(), torch.randn(2, 8, 16)
    begin_training_step([stack], 4)
    assert stack.act.aux_loss_scale == 0.25
    stack(x, None, None, StepContext(seed=1))[0].sum().backward()
    with_cost = stack.act.halting.bias.grad.clone()
    stack.zero_grad(set_to_none=True)
    stack.act.ponder_cost = 0.0
    stack(x, None, None, StepContext(seed=1))[0].sum().backward()
    assert not torch.allclose(with_cost, stack.act.halting.bias.grad)


def test_model_trains_and_evaluates():
    model = build_model(ModelConfig(**UT))
    ids = torch.randint(0, 64, (2, 8))
    model(ids).logsumexp(-1).mean().backward()
    assert model.stack.act.halting.weight.grad is not None
    with torch.no_grad():
        assert model.eval()(ids).shape == (2, 8, 64)
    assert model.stack.act.layer_metrics()["ponder_mean"] >= 1


@pytest.mark.parametrize("overrides,message", [
    (["model.share_layers=false"], "set model.share_layers=true"),
    (["model.family=encoder_decoder"], "model.family=decoder or encoder"),
    (["model.reversible=true"], "model.reversible=True chooses model.stack.kind=reversible but model.stack.kind=act is set"),
    (["model.attention.kind=realformer"], "RealFormer"),
    (["model.stack.options.threshold=1.0"], "model.stack.options.threshold must be in \\(0, 1\\)"),
    (["model.stack.options.ponder_cost=-1"], "model.stack.options.ponder_cost must be >= 0"),
])
def test_refused_model_options(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, ["model.stack=act", "model.share_layers=true", *overrides])
