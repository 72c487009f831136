"""The MoE configs load and validate; tiny-switch learns on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xscale.config.load import load_config
from xscale.models import build_model
from xscale.models.moe import collect_moe_metrics
from xscale.parallel.model import ParallelModel
from xscale.train.step import forward_backward_step

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("name,router,experts", [
    ("tiny-switch", "switch", 8), ("switch-base-8", "switch", 8),
    ("gshard-600b", "gshard", 2048), ("gshard-top2-8e", "gshard", 8),
])
def test_moe_configs_validate(name, router, experts):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.model.moe.router.kind == router and config.model.moe.num_experts == experts
    assert config.model.moe.num_experts % config.parallel.ep == 0


def test_tiny_switch_learns_a_repeating_sequence():
    config = load_config(CONFIGS / "tiny-switch.yaml", ["model.n_layers=2", "train.seq_len=32"])
    torch.manual_seed(0)
    model = build_model(config.model, seed=config.train.seed)
    engine = ParallelModel([model], micro_batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    pattern = torch.randint(0, config.model.vocab_size, (40,))
    starts = torch.randint(0, 8, (4,))
    sequences = torch.stack([pattern[s:s + 33] for s in starts])
    batch = {"input_ids": sequences[:, :-1], "labels": sequences[:, 1:]}
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        losses.append(forward_backward_step(engine, batch).item())
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0], losses
    metrics = collect_moe_metrics(model)
    assert "moe/layer1/dropped_fraction" in metrics and 0.0 <= metrics["moe/layer1/dropped_fraction"] < 1.0
