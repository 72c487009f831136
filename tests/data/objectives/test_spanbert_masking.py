"""SpanBERT's masking (Joshi et al. 2020, sec. 3.1), seeded: span lengths from Geo(0.2) truncated to 10 words (mean
3.8), exactly the 15% budget masked in whole words, spans apart so each has both boundary tokens, and the SBO
fields (boundaries, offsets) consistent with the masked positions."""

import pytest
import torch

from xscale.data.objectives import (
    IGNORE_INDEX,
    geometric_span_lengths,
    geometric_span_masking,
    truncated_geometric_mean,
)

MASK, SPECIAL = 1, [0, 1, 2, 3]


def _spans(sample: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(start, stop) of each masked span, read from span_offset == 1 and span_right."""
    starts = torch.nonzero(sample["span_offset"] == 1).flatten().tolist()
    return [(start, int(sample["span_right"][start])) for start in starts]


def _mask(tokens: torch.Tensor, seed: int, **options) -> dict[str, torch.Tensor]:
    return geometric_span_masking(tokens, torch.Generator().manual_seed(seed), vocab_size=100, mask_id=MASK,
                                  special_ids=SPECIAL, **options)


def test_truncated_geometric_mean_is_the_papers_3_8():
    p, q = 0.2, 0.8
    by_sum = sum(k * p * q ** (k - 1) for k in range(1, 11)) / sum(p * q ** (k - 1) for k in range(1, 11))
    assert truncated_geometric_mean(0.2, 10) == pytest.approx(by_sum) and round(by_sum, 1) == 3.8


def test_drawn_span_lengths_follow_the_truncated_geometric():
    lengths = geometric_span_lengths(200_000, torch.Generator().manual_seed(0), 0.2, 10)
    assert int(lengths.min()) == 1 and int(lengths.max()) == 10
    assert float(lengths.double().mean()) == pytest.approx(truncated_geometric_mean(0.2, 10), rel=0.01)
    counts = torch.bincount(lengths, minlength=11)[1:].double()
    assert float(counts[1] / counts[0]) == pytest.approx(0.8, rel=0.03)  # P(l+1) / P(l) = 1 - p


def test_masked_spans_keep_the_length_distribution_and_exactly_the_budget():
    lengths = []
    for seed in range(100):
        tokens = torch.randint(10, 100, (512,), generator=torch.Generator().manual_seed(1000 + seed))
        sample = _mask(tokens, seed)
        assert int((sample["labels"] != IGNORE_INDEX).sum()) == round(0.15 * 510)  # first and last never masked
        labelled = sample["labels"] != IGNORE_INDEX
        for start, stop in _spans(sample):
            assert not labelled[start - 1] and not labelled[stop], "spans never touch: both boundaries visible"
            lengths.append(stop - start)
    # Every span but the one the budget cuts keeps its drawn length; placing long spans is a little harder.
    assert sum(lengths) / len(lengths) == pytest.approx(truncated_geometric_mean(0.2, 10), rel=0.05)
    assert max(lengths) <= 10


def test_spans_are_whole_words_apart_with_consistent_boundary_fields():
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(10, 100, (200,), generator=generator)
    tokens[50] = 3  # a special token is never masked and ends a word
    word_starts = torch.rand(200, generator=generator) < 0.5
    sample = _mask(tokens, 3, word_starts=word_starts)
    labelled = sample["labels"] != IGNORE_INDEX
    assert not labelled[0] and not labelled[-1] and not labelled[50]
    for start, stop in _spans(sample):
        assert word_starts[start] or start == 51, "a span starts at a word"
        assert stop == 199 or word_starts[stop] or stop == 50 or not labelled[stop]
        assert not labelled[start - 1] and not labelled[stop], "both boundary tokens stay visible"
        assert torch.equal(sample["span_left"][start:stop], torch.full((stop - start,), start - 1))
        assert torch.equal(sample["span_offset"][start:stop], torch.arange(1, stop - start + 1))
        assert torch.equal(sample["labels"][start:stop], tokens[start:stop])
        kept = sample["input_ids"][start:stop]
        assert bool((kept == MASK).all()) or not bool((kept == MASK).any()), "a span is replaced as a whole"
    assert torch.equal(sample["span_offset"] > 0, labelled)
    assert torch.equal(sample["input_ids"][~labelled], tokens[~labelled])


def test_eighty_percent_of_spans_become_masks():
    masked_spans = total = 0
    for seed in range(100):
        tokens = torch.randint(10, 100, (256,), generator=torch.Generator().manual_seed(seed))
        sample = _mask(tokens, seed)
        for start, stop in _spans(sample):
            total += 1
            masked_spans += bool((sample["input_ids"][start:stop] == MASK).all())
    assert masked_spans / total == pytest.approx(0.8, abs=0.04)
