"""The content-based approximate cores learn to route: a tiny decoder trains on the copy task
(xscale.data.tasks.CopyTask), which no fixed local pattern can solve, to a stated held-out loss."""

from __future__ import annotations

import math

import pytest
import torch

from xscale.config.schema import AttentionConfig, ModelConfig
from xscale.data.datasets import TaskDataset, collate
from xscale.data.tasks import CopyTask
from xscale.models import build_model
from xscale.parallel.loss import model_loss_sum

LENGTH, SYMBOLS, BATCH, STEPS = 8, 8, 16, 200
SEQ_LEN = 2 * LENGTH + 2  # <s> x_1..x_8 <sep> x_1..x_8 (the last token is predicted, not input)


def copy_task_loss(kind: str, options: dict, *, seed: int = 0, steps: int = STEPS, d_model: int = 32,
                   n_heads: int = 2) -> float:
    """Held-out loss (nats per answer token) after ``steps`` AdamW steps; chance is ln(SYMBOLS) = 2.08."""
    task = CopyTask(SEQ_LEN, num_symbols=SYMBOLS, length=LENGTH)
    data = TaskDataset(task, "clm", SEQ_LEN, seed=seed, num_samples=steps * BATCH + 256)
    config = ModelConfig(vocab_size=task.vocab.vocab_size, d_model=d_model, n_layers=2, n_heads=n_heads,
                         max_seq_len=SEQ_LEN, position="learned", attention=AttentionConfig(kind=kind, options=options))
    model = build_model(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(steps):
        batch = collate([data[step * BATCH + i] for i in range(BATCH)])
        loss = model_loss_sum(model, batch) / (batch["labels"] != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        held_out = collate([data[steps * BATCH + i] for i in range(256)])
        return float(model_loss_sum(model, held_out) / (held_out["labels"] != -100).sum())


# The source of answer token t sits LENGTH + 1 positions back. Measured with these settings (held-out loss):
# dense 0.01, block_local (chunk 4, no neighbours) 2.09 = chance, sinkhorn 0.77-0.87 (two machines).
def test_sinkhorn_learns_the_copy_task() -> None:
    """Blocks of 4: the source block is 2-3 blocks back, reachable only through the learned sort."""
    loss = copy_task_loss("sinkhorn", {"block_size": 4})
    assert loss < 1.3 < math.log(SYMBOLS), f"sinkhorn: held-out copy loss {loss:.3f}"


# Routing assigns clusters by argmax, outside the gradient, so whether a run learns to route is chaotic: a change of
# rounding (one thread or two, AVX2 or AVX-512) moves one seed's loss anywhere between 0.2 and chance. Measured
# over seeds 0-5 with these settings: 0.30-1.94 at one thread, 0.36-1.59 at two, and no seed below 1.3 when keys
# are routed to a fixed local window (the source lies one key past the window). So the claim tested is "some seed
# of six learns to route", which a core that cannot route fails every time.
ROUTING_SEEDS = range(6)


@pytest.mark.slow
def test_routing_learns_the_copy_task() -> None:
    """A query sees at most 8 keys of its cluster; the fast EMA (decay 0.9) suits a short run."""
    losses = [copy_task_loss("routing", {"clusters": 4, "window": 8, "decay": 0.9}, seed=seed, steps=300,
                             d_model=64, n_heads=4) for seed in ROUTING_SEEDS]
    assert min(losses) < 1.0 < math.log(SYMBOLS), f"routing: held-out copy losses {losses}"
