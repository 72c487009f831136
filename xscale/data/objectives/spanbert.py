"""SpanBERT's geometric span masking for the span-boundary objective (Joshi et al. 2020, sec. 3.1); the head that
predicts each masked token from the span's boundaries is :mod:`xscale.models.heads.span_boundary`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from xscale.config.schema import ConfigError
from xscale.data.objectives.masked import MaskingOptions, masking_arguments, random_ordinary_tokens
from xscale.data.objectives.registry import IGNORE_INDEX, OBJECTIVES, Sample, TextObjective


@dataclasses.dataclass
class SpanBertOptions(MaskingOptions):
    geometric_p: float = dataclasses.field(default=0.2, metadata={
        "help": "span lengths in words follow Geo(p) truncated to 1..max_span_words (SpanBERT: 0.2)"})
    max_span_words: int = dataclasses.field(default=10, metadata={"help": "the longest span in words (SpanBERT: 10)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.geometric_p < 1:
            raise ConfigError(f"train.objective.options.geometric_p={self.geometric_p} (SpanBERT's Geo(p)) must be in "
                              "(0, 1)")
        if not 1 <= self.max_span_words <= 64:
            raise ConfigError(f"train.objective.options.max_span_words={self.max_span_words} must be in [1, 64]")


def truncated_geometric_mean(p: float, max_length: int) -> float:
    """E[l] for P(l) proportional to p (1-p)^(l-1) on 1..max_length: 1/p - L q^L / (1 - q^L), q = 1 - p (3.8 for
    SpanBERT's p=0.2, L=10)."""
    q = 1.0 - p
    return 1.0 / p - max_length * q**max_length / (1.0 - q**max_length)


def geometric_span_lengths(count: int, generator: torch.Generator, p: float = 0.2, max_length: int = 10
                           ) -> torch.Tensor:
    """``count`` span lengths from Geo(p) truncated to 1..max_length: P(l) proportional to p (1-p)^(l-1)."""
    lengths = torch.arange(1, max_length + 1, dtype=torch.float64)
    weights = p * (1 - p) ** (lengths - 1)
    return torch.multinomial(weights, count, replacement=True, generator=generator) + 1


START_TRIES = 16  # places tried for each drawn span before its length is drawn again


def geometric_span_masking(
    tokens: torch.Tensor,
    generator: torch.Generator,
    *,
    vocab_size: int,
    mask_id: int | None,
    special_ids: Sequence[int],
    word_starts: torch.Tensor | None = None,
    mask_probability: float = 0.15,
    geometric_p: float = 0.2,
    max_span_words: int = 10,
) -> dict[str, torch.Tensor]:
    """SpanBERT's masking (Joshi et al. 2020, sec. 3.1): spans of whole words until 15% of the tokens are masked.

    Each span's length in words is drawn from Geo(p=0.2) truncated to 1..10 (renormalised: the paper's mean of 3.8
    words), its first word uniformly among the places where the span fits; a place where it would overlap or touch a
    masked span is drawn again (16 tries, then a new length). The budget is round(15%) of the maskable tokens: the
    span that reaches it is cut to the whole words that fit (as SpanBERT's implementation cuts it), so with one
    token per word exactly the budget is masked, and every span but the last keeps the drawn length. Each span is
    replaced as a whole: 80% <mask>, 10% random tokens, 10% kept. The first and last positions of the window are
    never masked, so every span has both boundary tokens x_{s-1}, x_{e+1} for the span-boundary objective.
    ``word_starts`` (T,) marks the tokens that begin a word (None: every token is a word).

    Returns input_ids, labels (the original at masked positions, -100 elsewhere), and per position span_left /
    span_right (the boundary positions s-1, e+1) and span_offset (i - s + 1; 0 where unmasked).
    """
    if mask_id is None:
        raise ValueError("SpanBERT's masking needs a <mask> token; use a tokenizer trained by xscale "
                         "(xscale data tokenizer)")
    length = len(tokens)
    special = torch.tensor(sorted(set(special_ids)), dtype=tokens.dtype)
    maskable = ~torch.isin(tokens, special)
    maskable[0] = maskable[-1] = False
    starts = torch.ones(length, dtype=torch.bool) if word_starts is None else word_starts.clone()
    starts |= torch.cat([torch.ones(1, dtype=torch.bool), ~maskable[:-1]])  # a word never crosses a special token
    word_first = torch.nonzero(starts & maskable).flatten().tolist()
    boundary = (starts | ~maskable).tolist()
    word_stop = [next(j for j in range(first + 1, length) if boundary[j]) for first in word_first]
    budget = min(max(1, round(mask_probability * int(maskable.sum()))), int(maskable.sum()))
    open_, covered = maskable.tolist(), [False] * length
    spans: list[tuple[int, int]] = []
    masked = 0
    # Lengths and candidate places drawn at once: 2 x budget draws (each placed span masks a token at least).
    drawn_words = geometric_span_lengths(2 * budget, generator, geometric_p, max_span_words).tolist()
    place_fractions = torch.rand(2 * budget, START_TRIES, generator=generator, dtype=torch.float64).tolist()
    for words, fractions in zip(drawn_words, place_fractions):
        if masked >= budget or not word_first:
            break
        words = min(words, len(word_first))
        firsts = [int(fraction * (len(word_first) - words + 1)) for fraction in fractions]
        placed = ((word_first[first], word_stop[first + words - 1]) for first in firsts)
        free = next(((start, stop) for start, stop in placed
                     if all(open_[start:stop]) and not any(covered[start - 1:stop + 1])), None)
        if free is None:
            continue
        start, stop = free
        if stop - start > budget - masked:  # the last span: cut to the whole words the budget has left
            stop = max((end for end in word_stop if start < end <= start + budget - masked), default=start)
            if stop == start:
                break
        covered[start:stop] = [True] * (stop - start)
        spans.append((start, stop))
        masked += stop - start

    labels = torch.full_like(tokens, IGNORE_INDEX)
    inputs = tokens.clone()
    span_left, span_right, span_offset = (torch.zeros_like(tokens) for _ in range(3))
    for start, stop in spans:
        labels[start:stop] = tokens[start:stop]
        span_left[start:stop], span_right[start:stop] = start - 1, stop
        span_offset[start:stop] = torch.arange(1, stop - start + 1, dtype=tokens.dtype)
        action = float(torch.rand(1, generator=generator))
        if action < 0.8:
            inputs[start:stop] = mask_id
        elif action < 0.9:
            inputs[start:stop] = random_ordinary_tokens(stop - start, vocab_size, special, generator)
    return {"input_ids": inputs, "labels": labels, "span_left": span_left, "span_right": span_right,
            "span_offset": span_offset}


def word_start_table(tokenizer) -> torch.Tensor:
    """(vocab,) True for the tokens that begin a word: decoded after a letter, a space comes between them."""
    reference = tokenizer.encode("a")[-1]
    before = tokenizer.decode([reference]) + " "
    table = torch.tensor([tokenizer.decode([reference, token]).startswith(before)
                          for token in range(tokenizer.vocab_size)])
    table[torch.tensor(tokenizer.special_ids, dtype=torch.long)] = True
    return table


@OBJECTIVES.register("spanbert")
class SpanBert(TextObjective):
    """SpanBERT's span masking over windows of ``train.seq_len`` tokens, words as the tokenizer marks them; trains
    ``model.objective_head=span_boundary``."""

    Options = SpanBertOptions
    head = "span_boundary"

    def __init__(self, tokenizer, seq_len: int, stream, options: SpanBertOptions) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        self.arguments = masking_arguments(tokenizer, options)
        self.word_starts = word_start_table(tokenizer)

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        return geometric_span_masking(window, generator, word_starts=self.word_starts[window.long()],
                                      geometric_p=self.options.geometric_p,
                                      max_span_words=self.options.max_span_words, **self.arguments)
