"""ELECTRA's replaced-token detection (Clark et al. 2020): the generator's width, inverse-CDF sampling, and the loss
(generator MLM + lambda x the masked-count-weighted mean BCE of the discriminator on the corrupted tokens) against
a reference written out step by step."""

import torch
import torch.nn.functional as F

from xscale.config.schema import Component, ModelConfig
from xscale.data.datasets import collate
from xscale.data.objectives import IGNORE_INDEX, electra_masking
from xscale.models import build_model
from xscale.models.heads.replaced_token_detection import (
    ReplacedTokenDetectionOptions,
    generator_config,
    inverse_cdf_sample,
)
from xscale.parallel.loss import model_loss_sum
from xscale.runtime import StepContext

VOCAB, LENGTH, D, MASK = 40, 12, 32, 1


def _model(**options) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, max_seq_len=LENGTH,
                         position="learned", objective_head=Component("replaced_token_detection", options))
    return build_model(config, seed=0)


def test_the_generator_is_a_fraction_of_the_width():
    config = ModelConfig(d_model=256, n_heads=8, n_layers=6)
    small = generator_config(config, ReplacedTokenDetectionOptions(generator_fraction=0.25))
    assert (small.d_model, small.n_heads, small.n_layers) == (64, 2, 6)
    tiny = generator_config(config, ReplacedTokenDetectionOptions(generator_fraction=0.01, generator_layers=2))
    assert (tiny.d_model, tiny.n_heads, tiny.n_layers) == (32, 1, 2)
    model = _model(generator_fraction=0.5)
    assert model.objective_head.generate(torch.randn(3, LENGTH, D), StepContext()).shape == (3, LENGTH, D)


def test_inverse_cdf_sampling_picks_the_first_token_whose_cdf_reaches_the_uniform():
    logits = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    uniform = torch.rand(50, generator=torch.Generator().manual_seed(1))
    probabilities = torch.softmax(logits, dim=-1)
    expected = [next(token for token in range(7) if float(probabilities[row, :token + 1].sum()) >= float(uniform[row])
                     - 1e-6) for row in range(50)]
    assert inverse_cdf_sample(logits, uniform).tolist() == expected


def test_loss_matches_the_step_by_step_reference():
    samples = [electra_masking(torch.randint(5, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(seed)),
                               torch.Generator().manual_seed(seed), vocab_size=VOCAB, mask_id=MASK,
                               special_ids=[0, MASK], mask_probability=0.25) for seed in range(3)]
    batch = collate(samples)
    model = _model(rtd_weight=7.0)
    loss = model_loss_sum(model, batch)

    head, embedding = model.objective_head, model.output.weight
    masked = batch["labels"] != IGNORE_INDEX
    states = head.generate(model.embedding(batch["input_ids"]), StepContext())
    reference = F.cross_entropy(states[masked] @ embedding.T, batch["labels"][masked], reduction="sum")
    corrupted = batch["input_ids"].clone()
    for row, position in torch.nonzero(masked).tolist():
        cdf = torch.softmax(states[row, position] @ embedding.T, dim=-1).cumsum(0)
        corrupted[row, position] = int((cdf < batch["sample_uniform"][row, position] * cdf[-1]).sum())
    hidden = model(corrupted, project=False)
    original = torch.where(masked, batch["labels"], batch["input_ids"])
    probability = torch.sigmoid(head.discriminator_out(F.gelu(head.discriminator_dense(hidden))).squeeze(-1))
    replaced = (corrupted != original).float()
    bce = -(replaced * probability.log() + (1 - replaced) * (1 - probability).log())  # (B, T)
    for row in range(3):
        reference = reference + 7.0 * int(masked[row].sum()) * bce[row].mean()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert model.objective_head.generator_in.weight.grad.abs().sum() > 0, "the generator trains on its MLM loss"


def test_electra_masks_every_chosen_position_with_the_mask_token():
    tokens = torch.randint(5, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    sample = electra_masking(tokens, torch.Generator().manual_seed(0), vocab_size=VOCAB, mask_id=MASK,
                             special_ids=[0, MASK])
    chosen = sample["labels"] != IGNORE_INDEX
    assert int(chosen.sum()) == 30 and bool((sample["input_ids"][chosen] == MASK).all())
    assert torch.equal(sample["labels"][chosen], tokens[chosen]) and torch.equal(sample["input_ids"][~chosen],
                                                                                 tokens[~chosen])
    assert sample["sample_uniform"].shape == (200,) and 0 <= float(sample["sample_uniform"].min())
