"""Sampling rules: deterministic given a seed, top-k=1 is greedy, top-k and top-p keep what they specify."""

import pytest
import torch

from xscale.generation.sampling import Sampling, next_tokens, top_k_filter, top_p_filter


def _logits():
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_a_seed_fixes_the_draws():
    logits, sampling = _logits(), Sampling(1.3, top_k=10, top_p=0.95)
    draws = [torch.stack([next_tokens(logits, sampling, torch.Generator().manual_seed(seed)) for _ in range(1)])
             for seed in (5, 5, 6)]
    assert torch.equal(draws[0], draws[1])
    many = [next_tokens(logits, sampling, torch.Generator().manual_seed(seed)) for seed in range(20)]
    assert len({tuple(t.tolist()) for t in many}) > 1  # the draws do depend on the seed


def test_top_k_one_and_temperature_zero_are_greedy():
    logits = _logits()
    greedy = logits.argmax(-1)
    assert torch.equal(next_tokens(logits, Sampling(0.0)), greedy)
    for seed in range(5):
        assert torch.equal(next_tokens(logits, Sampling(2.0, top_k=1), torch.Generator().manual_seed(seed)), greedy)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(top_k_filter(logits, 2))
    assert kept.tolist() == [[False, True, False, True, False]]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probabilities = torch.tensor([[0.05, 0.5, 0.25, 0.15, 0.05]])
    logits = probabilities.log()
    # sorted: 0.5, 0.25, 0.15, ...; mass before each: 0, 0.5, 0.75, 0.9 -> p=0.7 keeps {0.5, 0.25}
    assert torch.isfinite(top_p_filter(logits, 0.7)).tolist() == [[False, True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.8)).tolist() == [[False, True, True, True, False]]
    assert torch.isfinite(top_p_filter(logits, 0.3)).tolist() == [[False, True, False, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    draws = {int(next_tokens(logits, Sampling(1.0, top_p=0.7), torch.Generator().manual_seed(s))) for s in range(40)}
    assert draws == {1, 2}


@pytest.mark.parametrize("fields, flag", [({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"),
                                          ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p")])
def test_bad_settings_name_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        Sampling(**fields)
