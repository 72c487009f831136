"""The pipeline cost model (FLOPs and parameter bytes per block, embedding, head and loss) and the split that
balances it when parallel.pp_split is unset."""

from __future__ import annotations

import itertools
import random

import pytest

from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.parallel.pipeline.cost import PipelineCosts, balanced_split, pipeline_costs, stage_layers

D, FF, V, T, B = 16, 32, 64, 8, 4
TINY = ["model.family=decoder", f"model.vocab_size={V}", f"model.d_model={D}", "model.n_layers=2", "model.n_heads=2",
        f"model.d_ff={FF}", "model.ffn=relu", "model.bias=false", "model.norm=rmsnorm", f"train.seq_len={T}",
        f"train.global_batch_size={B}"]


def test_costs_by_hand():
    costs = pipeline_costs(load_config(None, TINY))
    block_params = 4 * D * D + 2 * D * FF + 2 * D  # Q, K, V, O; W_in, W_out; two RMSNorm weights
    per_parameter = 16 * 10 / (B * T)  # 16 bytes (weight, gradient, two moments) at 10 FLOPs a byte, per token
    block = 3 * (2 * block_params + 4 * T * D) + per_parameter * block_params
    assert costs.blocks == pytest.approx([block, block])
    assert costs.embedding == pytest.approx(per_parameter * V * D)
    head_params = V * D + D  # the output projection (the tied copy) and the final norm
    assert costs.head == pytest.approx(3 * (2 * head_params + 10 * V) + per_parameter * head_params)


def test_a_moe_block_costs_the_experts_a_token_uses():
    dense = pipeline_costs(load_config(None, TINY)).blocks[0]
    moe = ["model.moe.num_experts=4", "model.moe.router=switch", "model.moe.top_k=1"]
    one_of_four = pipeline_costs(load_config(None, [*TINY, *moe])).blocks[0]
    ffn = 2 * D * FF
    # One expert's FLOPs (as dense) plus the router's; the other three experts only cost their parameter updates.
    assert one_of_four == pytest.approx(dense + 3 * 2 * 4 * D + 16 * 10 / (B * T) * (3 * ffn + 4 * D), rel=1e-6)


def brute_force(costs: PipelineCosts, stages: int) -> float:
    n = len(costs.blocks)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        layers = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
        best = min(best, max(costs.stage_costs(layers)))
    return best


def test_the_split_minimises_the_slowest_stage():
    assert balanced_split(PipelineCosts([1.0] * 4, embedding=0.0, head=1.3), 2) == [3, 1]  # [2, 2] leaves 3.3
    assert balanced_split(PipelineCosts([1.0] * 4, embedding=0.0, head=0.0), 2) == [2, 2]
    assert balanced_split(PipelineCosts([1.0] * 5, embedding=2.5, head=0.0), 3)[0] == 1  # the embedding's stage
    generator = random.Random(0)
    for _ in range(30):
        blocks = [generator.uniform(0.5, 2.0) for _ in range(generator.randint(3, 9))]
        costs = PipelineCosts(blocks, generator.uniform(0, 2), generator.uniform(0, 4))
        stages = generator.randint(2, min(4, len(blocks)))
        sizes = balanced_split(costs, stages)
        assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == len(blocks)
        bounds = [sum(sizes[:s]) for s in range(stages + 1)]
        layers = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
        assert max(costs.stage_costs(layers)) == pytest.approx(brute_force(costs, stages))


def test_pp_split_when_given_else_the_balanced_split():
    wide_vocab = load_config(None, [*TINY, "model.n_layers=4", "model.vocab_size=512"])  # only built on meta
    assert stage_layers(wide_vocab, 2) == [[0, 1, 2], [3]]  # the head costs more than a block: the last holds fewer
    wide_vocab.parallel.pp_split = [2, 2]
    assert stage_layers(wide_vocab, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="cannot fill 3 pipeline stages"):
        stage_layers(load_config(None, TINY), 3)
