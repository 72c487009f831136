"""Activation checkpointing recomputes the forward it repeats: its hash routing and dropout masks, even when other
forwards ran in between (as in a pipeline schedule)."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.parallel.activation import apply_activation_checkpointing
from xscale.runtime import StepContext


def hash_routed_decoder() -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=50, d_model=16, d_ff=32, n_layers=2, n_heads=2, dropout=0.2, attention_dropout=0.2,
                       max_seq_len=8, moe=MoEConfig(num_experts=4, router="hash", capacity_factor=1.0, min_capacity=0))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_replays_the_token_ids_and_dropout_of_its_forward(mode):
    ids = [torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    positions = [StepContext(seed=3, step=0, first_sample=2 * index) for index in range(2)]
    reference = build_model(hash_routed_decoder(), seed=4)
    reference(ids[0], context=positions[0]).square().mean().backward()

    checkpointed = build_model(hash_routed_decoder(), seed=4)
    apply_activation_checkpointing([checkpointed.stack], mode)
    losses = []
    for microbatch in range(2):  # both forwards first, then the first one's backward
        losses.append(checkpointed(ids[microbatch], context=positions[microbatch]).square().mean())
    losses[0].backward()
    expected = {name.replace("._checkpoint_wrapped_module", ""): param.grad
                for name, param in reference.named_parameters()}
    for name, param in checkpointed.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
