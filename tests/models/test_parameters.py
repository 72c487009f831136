"""Parameter counts: a MoE token uses its top-k experts' weights, so FLOPs per token count those, not all experts."""

from __future__ import annotations

import pytest

from xscale.config.load import load_config
from xscale.models.parameters import count_parameters
from xscale.train.metrics import flops_per_token

D, FF, E, LAYERS, SEQ, VOCAB = 16, 32, 4, 2, 8, 64
TINY_MOE = [f"model.vocab_size={VOCAB}", f"model.d_model={D}", f"model.n_layers={LAYERS}", "model.n_heads=2",
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
    head = VOCAB * D  # the tied LM head: the embedding matrix, multiplied by every token
    by_hand = 6 * (dense + LAYERS * per_token * one_expert + head) + 12 * LAYERS * SEQ * D
    assert flops_per_token(config.model, SEQ, count.matmul_per_token) == by_hand


def test_a_dense_model_uses_all_its_parameters():
    config = load_config(None, TINY_MOE[:-2])
    count = count_parameters(config)
    assert count.expert == 0 and count.active_non_embedding == count.non_embedding


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_lm_head_is_multiplied_by_every_token_tied_or_not(tied):
    """The head's V x d projection is a matmul per token whether or not it shares the embedding's matrix (the
    embedding's lookup is not): the same N either way, one head over the non-embedding weights."""
    config = load_config(None, [*TINY_MOE[:-2], f"model.tie_embeddings={str(tied).lower()}"])
    count = count_parameters(config)
    assert count.tied_head == (VOCAB * D if tied else 0)
    assert count.matmul_per_token == count.non_embedding + (VOCAB * D if tied else 0)
    untied = count_parameters(load_config(None, [*TINY_MOE[:-2], "model.tie_embeddings=false"]))
    assert count.matmul_per_token == untied.matmul_per_token == untied.non_embedding


def test_a_classifier_has_no_lm_head():
    config = load_config(None, [*TINY_MOE[:-2], "model.family=encoder", "model.num_classes=3"])
    count = count_parameters(config)
    assert count.tied_head == 0 and count.matmul_per_token == count.non_embedding
