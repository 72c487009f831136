"""Components defined per optimizer step (:mod:`xscale.train.training_step`) behave the same whatever the
microbatches a step runs: the adaptive-span penalty counts once per step, random features redraw every N steps."""

from __future__ import annotations

import copy

import torch

from xscale.config.schema import AttentionConfig, ModelConfig
from xscale.models import build_model
from xscale.models.attention.random_features import RandomFeatureAttention
from xscale.parallel.model import ParallelModel
from xscale.train.step import forward_backward_step
from xscale.train.training_step import begin_training_step

VOCAB, LENGTH, BATCH = 32, 12, 8


def _model(kind: str, **options) -> torch.nn.Module:
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=LENGTH,
                         attention=AttentionConfig(kind=kind, options=options))
    return build_model(config, seed=3)


def _batch(step: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(step))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def test_adaptive_span_penalty_counts_once_per_step_whatever_the_microbatches():
    """Gradients of CE / tokens + span_loss * sum_h z_h (once): one microbatch of 8 and four of 2 alike, and the
    penalty's own gradient is span_loss * max_span per head with z_h > 0, not a multiple of it."""
    model = _model("adaptive_span", max_span=16, ramp=4, span_loss=0.05)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("span_fraction"):
                parameter.copy_(torch.tensor([0.25, 0.5, -0.5, 0.75]))
    losses, grads = [], []
    for micro in (BATCH, 2):
        copied = copy.deepcopy(model)
        losses.append(forward_backward_step(ParallelModel([copied], micro_batch_size=micro), _batch(0)))
        grads.append({name: p.grad.clone() for name, p in copied.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)

    penalty_only = copy.deepcopy(model)  # the CE term's gradient removed: labels all ignored
    batch = dict(_batch(0), labels=torch.full((BATCH, LENGTH), -100))
    forward_backward_step(ParallelModel([penalty_only], micro_batch_size=2), batch)
    for name, parameter in penalty_only.named_parameters():
        if name.endswith("span_fraction"):
            torch.testing.assert_close(parameter.grad, torch.tensor([0.8, 0.8, 0.0, 0.8]), msg=name)


def _projections(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.projection.clone() for m in model.modules() if isinstance(m, RandomFeatureAttention)]


def test_random_features_redraw_every_n_optimizer_steps_whatever_the_microbatches():
    """redraw_every=2: steps 0-1 use draw 0, steps 2-3 draw 1, ... with one microbatch of 8 or four of 2 (whose
    forwards a per-call count would take for steps), so the two runs' losses stay equal."""
    for kind in ("performer", "rfa"):
        runs = []
        for micro in (BATCH, 2):
            model = _model(kind, features=16, redraw_every=2)
            engine = ParallelModel([model], micro_batch_size=micro)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            draws, losses = [], []
            for step in range(5):
                losses.append(float(forward_backward_step(engine, _batch(step))))
                draws.append(_projections(model))
                optimizer.step()
                optimizer.zero_grad()
            runs.append((losses, draws))
        (losses, draws), (micro_losses, micro_draws) = runs
        torch.testing.assert_close(torch.tensor(micro_losses), torch.tensor(losses), rtol=1e-5, atol=0, msg=kind)
        for step, (expected, got) in enumerate(zip(draws, micro_draws)):
            for a, b in zip(expected, got):
                assert torch.equal(a, b), f"{kind}: features of step {step}"
        changed = [not torch.equal(draws[step][0], draws[step - 1][0]) for step in range(1, 5)]
        assert changed == [False, True, False, True], f"{kind}: redraws at steps 2 and 4 only, got {changed}"


def test_begin_training_step_reaches_a_shared_block_once():
    """A block shared across depths (share_layers) is one module: its schedule advances once per step."""
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, max_seq_len=LENGTH, share_layers=True,
                         attention=AttentionConfig(kind="performer", options={"features": 16, "redraw_every": 1}))
    model = build_model(config, seed=3)
    begin_training_step([model, model], forwards=2)
    (core,) = [m for m in model.modules() if isinstance(m, RandomFeatureAttention)]
    assert int(core.calls) == 1
