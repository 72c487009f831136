"""Pre-training objectives as maps from a token window to a model batch: causal LM (GPT), masked LM with
BERT's 80/10/10 rule (Devlin et al. 2019, sec. 3.1), T5 span corruption (Raffel et al. 2020, sec. 3.1.4), BART
denoising, sentence permutation plus text infilling (Lewis et al. 2020, sec. 2.2), SpanBERT's geometric span
masking for the span-boundary objective (Joshi et al. 2020) and the sentence pairs of BERT's next-sentence and
ALBERT's sentence-order prediction (Lan et al. 2020), and ELECTRA's masking for replaced-token detection (Clark et
al. 2020).

Labels use -100 for positions that carry no loss. Every random choice comes from the ``generator`` the
caller passes, so a dataset seeded by (seed, global sample index) gives the same sample on any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xscale.config.schema import Config, ConfigError

IGNORE_INDEX = -100


def causal_lm(window: torch.Tensor) -> dict[str, torch.Tensor]:
    """A window of T+1 tokens: predict token t+1 from tokens <= t."""
    return {"input_ids": window[:-1].clone(), "labels": window[1:].clone()}


def masked_lm(
    tokens: torch.Tensor,
    generator: torch.Generator,
    *,
    vocab_size: int,
    mask_id: int | None,
    special_ids: Sequence[int],
    mask_probability: float = 0.15,
) -> dict[str, torch.Tensor]:
    """Choose round(15%) of the maskable positions; of those 80% become <mask>, 10% a random token, 10% stay.

    Labels hold the original token at chosen positions only.
    """
    if mask_id is None:
        raise ValueError("masked LM needs a <mask> token; use a tokenizer trained by xscale (xscale data tokenizer)")
    special = torch.tensor(sorted(set(special_ids)), dtype=tokens.dtype)
    candidates = torch.nonzero(~torch.isin(tokens, special)).flatten()
    count = min(len(candidates), max(1, round(mask_probability * len(candidates))))
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]

    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[chosen] = tokens[chosen]
    inputs = tokens.clone()
    action = torch.rand(count, generator=generator)
    replace_with_mask = chosen[action < 0.8]
    replace_with_random = chosen[(action >= 0.8) & (action < 0.9)]
    inputs[replace_with_mask] = mask_id
    inputs[replace_with_random] = _random_ordinary_tokens(len(replace_with_random), vocab_size, special, generator)
    return {"input_ids": inputs, "labels": labels}


def _random_ordinary_tokens(count: int, vocab_size: int, special: torch.Tensor, generator: torch.Generator
                            ) -> torch.Tensor:
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[special[special < vocab_size]] = False
    pool = torch.nonzero(ordinary).flatten()
    return pool[torch.randint(len(pool), (count,), generator=generator)]


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
            inputs[start:stop] = _random_ordinary_tokens(stop - start, vocab_size, special, generator)
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


PAIR_KINDS = ("nsp", "sop")
SegmentSource = Callable[[int, torch.Generator], torch.Tensor]


def sentence_pair(
    tokens: torch.Tensor,
    generator: torch.Generator,
    *,
    kind: str,
    cls_id: int,
    sep_id: int,
    vocab_size: int,
    mask_id: int | None,
    special_ids: Sequence[int],
    random_segment: SegmentSource | None = None,
    mask_probability: float = 0.15,
) -> dict[str, torch.Tensor]:
    """A pair of segments [CLS] A [SEP] B [SEP] from a window of T - 3 tokens, MLM-masked, with a pair label.

    The window is cut at a uniform point into A (first) and B (next), each at least one token. ``nsp`` (BERT,
    Devlin et al. 2019, sec. 3.1): with probability 1/2 B is replaced by as many tokens read at a random place of the
    corpus (``random_segment``), pair_label 1 (NotNext), else 0 (IsNext). ``sop`` (ALBERT, Lan et al. 2020, sec.
    4.1): with probability 1/2 the two segments are swapped, B then A, pair_label 1, else 0. Then BERT's masking
    (:func:`masked_lm`) over every token but the three separators. Departure: no segment (token-type) embeddings;
    the separator marks the boundary.
    """
    if kind not in PAIR_KINDS:
        raise ValueError(f"sentence pair kind '{kind}' is not one of {', '.join(PAIR_KINDS)}")
    if len(tokens) < 2:
        raise ValueError(f"a sentence pair needs a window of at least 2 tokens (train.seq_len >= 5), got {len(tokens)}")
    cut = int(torch.randint(1, len(tokens), (1,), generator=generator))
    first, second = tokens[:cut], tokens[cut:]
    flipped = bool(torch.rand(1, generator=generator) < 0.5)
    if flipped and kind == "sop":
        first, second = second, first
    elif flipped:
        if random_segment is None:
            raise ValueError("next-sentence prediction needs a corpus to draw random second segments from")
        second = random_segment(len(second), generator).to(tokens.dtype)
    cls, sep = (torch.tensor([token], dtype=tokens.dtype) for token in (cls_id, sep_id))
    pair = torch.cat([cls, first, sep, second, sep])
    sample = masked_lm(pair, generator, vocab_size=vocab_size, mask_id=mask_id,
                       special_ids=[*special_ids, cls_id, sep_id], mask_probability=mask_probability)
    sample["pair_label"] = torch.tensor(int(flipped))
    return sample


def electra_masking(tokens: torch.Tensor, generator: torch.Generator, *, vocab_size: int, mask_id: int | None,
                    special_ids: Sequence[int], mask_probability: float = 0.15) -> dict[str, torch.Tensor]:
    """ELECTRA (Clark et al. 2020, sec. 2): round(15%) of the maskable positions, every one replaced by <mask>
    (x_masked = REPLACE(x, m, [MASK])); labels hold the originals there. ``sample_uniform`` (T,): one uniform per
    position, from which the generator's sample is drawn (by inverse CDF), so it is the same under any layout."""
    sample = masked_lm(tokens, generator, vocab_size=vocab_size, mask_id=mask_id, special_ids=special_ids,
                       mask_probability=mask_probability)
    sample["input_ids"] = torch.where(sample["labels"] != IGNORE_INDEX, mask_id, tokens)
    sample["sample_uniform"] = torch.rand(len(tokens), generator=generator)
    return sample


def span_lengths(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """(noise tokens, spans) for a window of ``length``: fixed by the length, so every sample has one shape."""
    noise = min(max(1, round(length * noise_density)), length - 1)
    spans = min(max(1, round(noise / mean_span_length)), length - noise)
    return noise, spans


def span_corruption_lengths(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0
                            ) -> tuple[int, int]:
    """(encoder input length, target length) that span corruption gives a window of ``length`` tokens."""
    noise, spans = span_lengths(length, noise_density, mean_span_length)
    return length - noise + spans + 1, noise + spans + 1


def _random_partition(total: int, parts: int, generator: torch.Generator) -> torch.Tensor:
    """``parts`` positive integers summing to ``total``, uniformly over such compositions."""
    cuts = torch.randperm(total - 1, generator=generator)[:parts - 1] + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values, torch.tensor([total])])
    return bounds.diff()


def random_spans_noise_mask(length: int, generator: torch.Generator, noise_density: float = 0.15,
                            mean_span_length: float = 3.0) -> torch.Tensor:
    """Boolean mask of noise positions: ``spans`` noise runs interleaved with as many kept runs, kept first."""
    noise, spans = span_lengths(length, noise_density, mean_span_length)
    noise_runs = _random_partition(noise, spans, generator)
    kept_runs = _random_partition(length - noise, spans, generator)
    runs = torch.stack([kept_runs, noise_runs], dim=1).flatten()
    is_noise = torch.arange(2 * spans) % 2 == 1
    return torch.repeat_interleave(is_noise, runs)


def span_corruption(
    tokens: torch.Tensor,
    generator: torch.Generator,
    *,
    sentinel_ids: Sequence[int],
    eos_id: int,
    decoder_start_id: int,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> dict[str, torch.Tensor]:
    """T5: each noise span becomes one sentinel in the input; the target lists sentinel + span for each span.

    input_ids = kept tokens with <extra_id_i> in place of span i, then eos; labels = <extra_id_0> span_0
    <extra_id_1> span_1 ... eos; decoder_input_ids = labels shifted right behind ``decoder_start_id``.
    """
    length = len(tokens)
    if length < 2:
        raise ValueError(f"span corruption needs a window of at least 2 tokens, got {length}")
    noise_mask = random_spans_noise_mask(length, generator, noise_density, mean_span_length)
    _, spans = span_lengths(length, noise_density, mean_span_length)
    if spans > len(sentinel_ids):
        raise ValueError(f"span corruption of {length} tokens needs {spans} sentinels but the tokenizer has "
                         f"{len(sentinel_ids)}; train it with more (xscale data tokenizer) or shorten train.seq_len")
    sentinels = torch.tensor(list(sentinel_ids[:spans]), dtype=tokens.dtype)
    span_starts = noise_mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), noise_mask[:-1]])
    span_index = torch.cumsum(span_starts.long(), 0) - 1
    eos = torch.tensor([eos_id], dtype=tokens.dtype)

    inputs = tokens.clone()
    inputs[span_starts] = sentinels
    keep_in_input = ~noise_mask | span_starts
    input_ids = torch.cat([inputs[keep_in_input], eos])

    # Target: every noise token, each span preceded by its sentinel.
    target_positions = torch.nonzero(noise_mask).flatten()
    target = []
    for position in target_positions.tolist():
        if span_starts[position]:
            target.append(sentinels[span_index[position]])
        target.append(tokens[position])
    labels = torch.cat([torch.stack(target), eos]) if target else eos
    decoder_input_ids = torch.cat([torch.tensor([decoder_start_id], dtype=tokens.dtype), labels[:-1]])
    return {"input_ids": input_ids, "labels": labels, "decoder_input_ids": decoder_input_ids}


def sentence_permutation(tokens: torch.Tensor, generator: torch.Generator, *, sentence_end_ids: Sequence[int]
                         ) -> torch.Tensor:
    """BART's sentence permutation (Lewis et al. 2020, sec. 2.2): the window split into sentences, each ending at
    a sentence-end token (the last may run to the window's end without one), shuffled into a random order."""
    ends = torch.isin(tokens, torch.tensor(list(sentence_end_ids), dtype=tokens.dtype))
    stops = [stop for stop in (torch.nonzero(ends).flatten() + 1).tolist() if stop < len(tokens)] + [len(tokens)]
    starts = [0, *stops[:-1]]
    sentences = [tokens[start:stop] for start, stop in zip(starts, stops)]
    order = torch.randperm(len(sentences), generator=generator).tolist()
    return torch.cat([sentences[index] for index in order])


def infilling_spans(length: int, generator: torch.Generator, mask_ratio: float = 0.3, poisson_lambda: float = 3.0
                    ) -> list[tuple[int, int]]:
    """(start, length) of BART's text-infilling spans over a window of ``length``, by start, disjoint and apart.

    Span lengths are drawn from Poisson(lambda) until they cover round(mask_ratio * length) tokens (the last cut to
    that count); zero-length spans stay (each inserts a mask), except that spans are at most as many as the masked
    tokens, so the corrupted input never outgrows the window. The spans go into distinct gaps between the kept
    tokens (gap g: just before kept token g), uniformly, so no two spans touch.
    """
    target = min(round(mask_ratio * length), length)
    lengths: list[int] = []
    rate = torch.tensor([float(poisson_lambda)])
    while sum(lengths) < target:
        lengths.append(min(int(torch.poisson(rate, generator=generator)), target - sum(lengths)))
    while len(lengths) > max(target, 1) and 0 in lengths:
        del lengths[len(lengths) - 1 - lengths[::-1].index(0)]  # the last zero-length span
    kept = length - target
    gaps = torch.randperm(kept + 1, generator=generator)[:len(lengths)].sort().values.tolist()
    spans, masked_before = [], 0
    for gap, span_length in zip(gaps, lengths):
        spans.append((gap + masked_before, span_length))
        masked_before += span_length
    return spans


def text_infilling(tokens: torch.Tensor, spans: list[tuple[int, int]], mask_id: int) -> torch.Tensor:
    """BART's text infilling: each (start, length) span replaced by ONE mask token (a zero-length span inserts one)."""
    pieces, position = [], 0
    mask = torch.tensor([mask_id], dtype=tokens.dtype)
    for start, span_length in spans:
        pieces += [tokens[position:start], mask]
        position = start + span_length
    pieces.append(tokens[position:])
    return torch.cat(pieces)


def bart_denoising(
    tokens: torch.Tensor,
    generator: torch.Generator,
    *,
    mask_id: int | None,
    pad_id: int,
    decoder_start_id: int,
    sentence_end_ids: Sequence[int],
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
) -> dict[str, torch.Tensor]:
    """BART (Lewis et al. 2020, sec. 2.2): sentence permutation, then text infilling; the decoder rebuilds the window.

    input_ids = the corrupted window right-padded with ``pad_id`` to the window's length (one shape per batch);
    labels = the original window, every token of it; decoder_input_ids = labels shifted right behind
    ``decoder_start_id`` (teacher forcing).
    """
    if mask_id is None:
        raise ValueError("BART denoising needs a <mask> token; use a tokenizer trained by xscale (xscale data tokenizer)")
    permuted = sentence_permutation(tokens, generator, sentence_end_ids=sentence_end_ids)
    corrupted = text_infilling(permuted, infilling_spans(len(tokens), generator, mask_ratio, poisson_lambda), mask_id)
    padding = torch.full((len(tokens) - len(corrupted),), pad_id, dtype=tokens.dtype)
    decoder_input_ids = torch.cat([torch.tensor([decoder_start_id], dtype=tokens.dtype), tokens[:-1]])
    return {"input_ids": torch.cat([corrupted, padding]), "labels": tokens.clone(), "decoder_input_ids": decoder_input_ids}


def check_bart_config(config: Config) -> None:
    """train.objective=bart corrupts windows of text (not the synthetic tasks' examples), with its options in range."""
    if config.train.objective != "bart":
        return
    data = config.data
    if data.dataset.kind not in ("stdlib_text", "text", "indexed") and not data.sources:
        raise ConfigError(f"train.objective=bart corrupts windows of text: set data.dataset=stdlib_text, text or "
                          f"indexed (or data.sources), not data.dataset={data.dataset}")
    ratio, rate = data.dataset.options.get("mask_ratio", 0.3), data.dataset.options.get("poisson_lambda", 3.0)
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 0.5):
        raise ConfigError(f"data.dataset.options.mask_ratio={ratio!r} (BART's masked fraction) must be in (0, 0.5]")
    if not (isinstance(rate, (int, float)) and 0 <= rate <= 64):
        raise ConfigError(f"data.dataset.options.poisson_lambda={rate!r} (BART's mean span length) must be in [0, 64]")


# The extra head each objective trains beside the MLM (model.objective_head), and why each layout cannot apply.
OBJECTIVE_HEADS = {"spanbert": "span_boundary", "nsp": "sentence_pair", "sop": "sentence_pair",
                   "electra": "replaced_token_detection"}
HEAD_REFUSALS = {
    "pp": "the head reads the last stage's states together with the batch's boundary positions or pair labels, "
          "which pipeline stages do not carry",
    "tp": "the head is not in the tensor-parallel plan",
    "cp": "a span's boundary tokens, a pair's first token or the generator's sequence may sit on another rank's part",
}


def check_bert_objectives(config: Config) -> None:
    """train.objective=spanbert, nsp, sop or electra: windows of text, the matching model.objective_head, options in range,
    and the layouts the heads cannot run under refused by name."""
    objective, head = config.train.objective, config.model.objective_head.kind
    wanted = OBJECTIVE_HEADS.get(objective, "none")
    if head != wanted:
        fix = f"set model.objective_head={wanted}" if wanted != "none" else \
            f"set train.objective to {' or '.join(k for k, v in OBJECTIVE_HEADS.items() if v == head)}"
        raise ConfigError(f"train.objective={objective} trains model.objective_head={wanted}, not {head}; {fix}")
    if objective not in OBJECTIVE_HEADS:
        return
    data, options = config.data, config.data.dataset.options
    if config.train.task != "lm":
        raise ConfigError(f"train.objective={objective} pre-trains with token losses: set train.task=lm, not "
                          f"{config.train.task}")
    if data.dataset.kind not in ("stdlib_text", "text", "indexed") and not data.sources:
        raise ConfigError(f"train.objective={objective} masks windows of text: set data.dataset=stdlib_text, text or "
                          f"indexed (or data.sources), not data.dataset={data.dataset}")
    if objective == "nsp" and data.sources:
        raise ConfigError("train.objective=nsp draws random second segments from one corpus: set data.dataset and "
                          "data.path instead of data.sources (or use train.objective=sop)")
    if config.model.lm_head_transform:
        raise ConfigError(f"train.objective={objective}: the {wanted} head reads the encoder's final states, which "
                          "model.lm_head_transform would hand the loss transformed; set model.lm_head_transform=false")
    for dimension, reason in HEAD_REFUSALS.items():
        if getattr(config.parallel, dimension) > 1:
            raise ConfigError(f"train.objective={objective} cannot run under parallel.{dimension}="
                              f"{getattr(config.parallel, dimension)}: {reason}; use dp and ZeRO (parallel.zero_stage)")
    probability = options.get("mask_probability", 0.15)
    if not (isinstance(probability, (int, float)) and 0 < probability <= 0.5):
        raise ConfigError(f"data.dataset.options.mask_probability={probability!r} (the masked fraction) must be in "
                          "(0, 0.5]")
    geometric_p, max_words = options.get("geometric_p", 0.2), options.get("max_span_words", 10)
    if not (isinstance(geometric_p, (int, float)) and 0 < geometric_p < 1):
        raise ConfigError(f"data.dataset.options.geometric_p={geometric_p!r} (SpanBERT's Geo(p)) must be in (0, 1)")
    if not (isinstance(max_words, int) and 1 <= max_words <= 64):
        raise ConfigError(f"data.dataset.options.max_span_words={max_words!r} must be an integer in [1, 64]")
    if objective in PAIR_KINDS and config.train.seq_len < 5:
        raise ConfigError(f"train.objective={objective} lays out [CLS] A [SEP] B [SEP]: train.seq_len must be at least "
                          f"5, got {config.train.seq_len}")
