"""BART denoising (Lewis et al. 2020, sec. 2.2) against hand-written references: text infilling puts one mask per
Poisson span (a zero-length span inserts one) over 30% of the window, sentence permutation keeps every sentence,
and the decoder's target is the original window."""

import torch

from xscale.data.objectives import bart_denoising, infilling_spans, sentence_permutation, text_infilling

MASK, PAD, START, END = 1, 0, 2, 3
TOKENS = torch.arange(10, 20)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _infill_reference(tokens: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Token by token: a mask where a span starts (before the token a zero-length span points at), its tokens
    skipped."""
    starts = {start: length for start, length in spans}
    out, skip = [], 0
    for position in range(len(tokens) + 1):
        if position in starts:
            out.append(MASK)
            skip = starts[position]
        if position == len(tokens):
            break
        if skip:
            skip -= 1
            continue
        out.append(tokens[position])
    return out


def test_text_infilling_puts_one_mask_per_span_and_a_zero_length_span_inserts_one():
    got = text_infilling(TOKENS, [(1, 2), (5, 0), (7, 3)], MASK).tolist()
    assert got == [10, MASK, 13, 14, MASK, 15, 16, MASK]
    assert got == _infill_reference(TOKENS.tolist(), [(1, 2), (5, 0), (7, 3)])


def test_infilling_spans_cover_30_percent_apart_with_poisson_lengths():
    lengths, zero_length, length = [], 0, 40
    for seed in range(300):
        spans = infilling_spans(length, _generator(seed))
        assert sum(span for _, span in spans) == round(0.3 * length)
        for (start, span), (next_start, _) in zip(spans, spans[1:]):
            assert next_start > start + span, spans  # disjoint, a kept token between any two
        assert spans[-1][0] + spans[-1][1] <= length
        tokens = list(range(100, 100 + length))
        corrupted = text_infilling(torch.tensor(tokens), spans, MASK).tolist()
        assert corrupted == _infill_reference(tokens, spans)
        assert corrupted.count(MASK) == len(spans) and len(corrupted) == length - 12 + len(spans)
        zero_length += sum(span == 0 for _, span in spans)
        lengths += [span for _, span in spans]
    assert zero_length > 0  # Poisson(3) gives 0 about 5% of the time
    assert 2.2 < sum(lengths) / len(lengths) < 3.2  # about lambda (the last span of each window is cut short)


def test_sentence_permutation_keeps_every_sentence():
    tokens = torch.tensor([5, 6, END, 7, END, 8, 9, 10, END, 11, 12])  # the last sentence runs off the window
    sentences = sorted([(5, 6, END), (7, END), (8, 9, 10, END), (11, 12)])
    orders = set()
    for seed in range(30):
        permuted = sentence_permutation(tokens, _generator(seed), sentence_end_ids=[END]).tolist()
        pieces, current = [], []
        for token in permuted:
            current.append(token)
            if token == END or (token == 12 and current[0] == 11):
                pieces.append(tuple(current))
                current = []
        assert sorted(pieces) == sentences and not current, permuted
        orders.add(tuple(permuted))
    assert len(orders) > 10  # 4! orders, drawn at random


def test_the_encoder_reads_the_corrupted_window_padded_and_the_decoder_rebuilds_the_original():
    window = torch.tensor([5, 6, END, 7, 8, 9, END, 10, 11, 12, 13, END, 14, 15, 16, 17, 18, 19, 20, 21])
    for seed in range(20):
        sample = bart_denoising(window, _generator(seed), mask_id=MASK, pad_id=PAD, decoder_start_id=START,
                                sentence_end_ids=[END])
        assert torch.equal(sample["labels"], window)
        assert sample["decoder_input_ids"].tolist() == [START, *window[:-1].tolist()]
        inputs = sample["input_ids"].tolist()
        real = inputs[:len(inputs) - inputs[::-1].index(next(t for t in inputs[::-1] if t != PAD))]
        assert len(inputs) == len(window) and set(inputs[len(real):]) <= {PAD}
        assert real.count(MASK) >= 1 and len(real) - real.count(MASK) == len(window) - round(0.3 * len(window))
        assert sorted(t for t in real if t != MASK) != sorted(window.tolist())  # 30% of the tokens are gone
