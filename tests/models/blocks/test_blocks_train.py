"""Every block kind and model.init=admin train: the loss of a tiny model falls on the periodic task of
tests/models/test_components_train.py."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_components_train import _batch
from xscale.config.schema import Component, ModelConfig
from xscale.models import build_model
from xscale.models.registry import BLOCK
from xscale.parallel.model import ParallelModel
from xscale.train.step import forward_backward_step

CASES = {
    "standard": dict(block="standard"),
    "macaron": dict(block="macaron"),
    "sandwich": dict(n_layers=3, block=Component("sandwich", {"coefficient": 1})),
    "gtrxl": dict(block="gtrxl"),
    "evolved": dict(block="evolved"),
    "lite": dict(block=Component("lite", {"kernel_size": 3, "conv_heads": 4})),
    "delight": dict(position="learned", block=Component("delight", {"min_depth": 2, "max_depth": 4, "max_groups": 4})),
    "admin": dict(norm="layernorm", norm_placement="post", init="admin"),
}


def test_every_block_kind_has_a_training_case() -> None:
    assert set(BLOCK.names()) <= {str(case.get("block")) for case in CASES.values()}


@pytest.mark.parametrize("name", list(CASES))
def test_block_kind_trains(name) -> None:
    torch.manual_seed(0)
    config = ModelConfig(**dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=16) | CASES[name])
    model = build_model(config, seed=1)
    engine = ParallelModel([model], micro_batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        losses.append(float(forward_backward_step(engine, _batch(config.family, step))))
        optimizer.step()
        optimizer.zero_grad()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"{name}: loss went from {first:.3f} to {last:.3f}"
