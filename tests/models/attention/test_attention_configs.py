"""The real-size efficient-attention configs: parameter counts against the published models, and sparse layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xscale.config.load import load_config
from xscale.models.attention.block_sparse import build_plan
from xscale.models.attention.core import build_core
from xscale.models.parameters import count_parameters

CONFIGS = Path(__file__).parents[3] / "configs"
HIDDEN = 768

# Published counts of HF BigBirdForMaskedLM (google/bigbird-roberta-base) and LongformerForMaskedLM
# (allenai/longformer-base-4096), minus the parts xscale does not build: token-type rows (folded into the
# position table), BigBird's unused pooler, Longformer's separate global q/k/v projections and its 2 offset rows.
PUBLISHED = {
    "bigbird-base.yaml": 128_111_286 - 2 * HIDDEN - (HIDDEN * HIDDEN + HIDDEN),
    "longformer-base.yaml": 148_711_257 - 12 * 3 * (HIDDEN * HIDDEN + HIDDEN) - 3 * HIDDEN,
}


@pytest.mark.parametrize("name,expected", list(PUBLISHED.items()))
def test_published_parameter_counts(name: str, expected: int) -> None:
    assert count_parameters(load_config(CONFIGS / name)).total == expected


def test_sparse_transformer_is_the_published_95m_without_its_position_table() -> None:
    config = load_config(CONFIGS / "sparse-transformer.yaml")
    model = config.model
    without_positions = count_parameters(config).total - model.max_seq_len * model.d_model
    assert abs(without_positions - 95e6) / 95e6 < 0.01  # 94,703,616
    assert [model.attention.kind_for_layer(i) for i in range(4)] == ["strided", "fixed", "strided", "fixed"]


@pytest.mark.parametrize("name,bound", [("bigbird-base.yaml", 0.2), ("longformer-base.yaml", 0.25)])
def test_layouts_are_sparse_at_4096_tokens(name: str, bound: float) -> None:
    """Measured non-zero block fractions of the 64 x 64 block grid: bigbird 0.147, longformer 0.165."""
    config = load_config(CONFIGS / name)
    core = build_core(config.model.attention.kind, config.model, 0, config.model.attention.options, False, False)
    block = core.options.block_size
    plan = build_plan(core.pattern, config.train.seq_len, block, False, 1, 1, torch.device("cpu"))
    assert plan.nonzero_blocks / plan.n_blocks**2 < bound
