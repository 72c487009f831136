"""Parameter counts: a MoE token uses its top-k experts' weights, so FLOPs per token count those, not all experts."""

from __future__ import annotations

import pytest

from xscale.models.parameters import count_parameters
from xscale.train.metrics import flops_per_token
from xscale.validate import load_config

D, FF, E, LAYERS, SEQ = 16, 32, 4, 2, 8
TINY_MOE = ["model.vocab_size=64", f"model.d_model={D}", f"model.n_layers={LAYERS}", "model.n_heads=2",
            f"model.d_ff={FF}", "model.ffn=relu", "model.bias=false", f"model.moe.num_experts={E}",
            f"train.seq_len={SEQ}"]


@pytest.mark.parametrize(("router", "top_k", "per_token"), [("gshard", 2, 2), ("switch", 1, 1), ("hash", 1, 1)])
def test_flops_per_token_count_the_experts_a_token_uses(router, top_k, per_token):
    config = load_config(None, [*TINY_MOE, f"model.moe.router={router}", f"model.moe.top_k={top_k}"])
    count = count_parameters(config)
    one_expert = 2 * D * FF  # a ReLU FFN without biases: W_in [d, d_ff] and W_out [d_ff, d]
    assert count.expert == LAYERS * E * one_expert
    dense = count.non_embedding - count.expert  # attention, norms, routers
    assert count.active_non_embedding == dense + LAYERS * per_token * one_expert
    by_hand = 6 * (dense + LAYERS * per_token * one_expert) + 12 * LAYERS * SEQ * D
    assert flops_per_token(config.model, SEQ, count.active_non_embedding) == by_hand


def test_a_dense_model_uses_all_its_parameters():
    config = load_config(None, TINY_MOE[:-2])
    count = count_parameters(config)
    assert count.expert == 0 and count.active_non_embedding == count.non_embedding
