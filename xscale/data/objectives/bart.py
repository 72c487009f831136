"""BART denoising (Lewis et al. 2020, sec. 2.2): sentence permutation, then text infilling; the decoder rebuilds the
window."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from xscale.config.schema import ConfigError
from xscale.data.objectives.registry import OBJECTIVES, Sample, TextObjective


@dataclasses.dataclass
class BartOptions:
    mask_ratio: float = dataclasses.field(default=0.3, metadata={
        "help": "the fraction of each window's tokens in infilled spans (BART: 30%)"})
    poisson_lambda: float = dataclasses.field(default=3.0, metadata={
        "help": "span lengths follow Poisson(lambda) (BART: 3)"})

    def __post_init__(self) -> None:
        if not 0 < self.mask_ratio <= 0.5:
            raise ConfigError(f"train.objective.options.mask_ratio={self.mask_ratio} (BART's masked fraction) must be "
                              "in (0, 0.5]")
        if not 0 <= self.poisson_lambda <= 64:
            raise ConfigError(f"train.objective.options.poisson_lambda={self.poisson_lambda} (BART's mean span "
                              "length) must be in [0, 64]")


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


def sentence_end_ids(tokenizer) -> list[int]:
    """BART's sentence boundaries: eos (a document's end) and the pieces that read "." (a full stop) alone or after
    a word or a space (a subword tokenizer may have one piece for each)."""
    last_pieces = {ids[-1] for ids in (tokenizer.encode(text) for text in (".", " .", "end.")) if ids}
    full_stops = [piece for piece in last_pieces if tokenizer.decode([piece]).strip() == "."]
    return sorted({tokenizer.eos_id, *full_stops})


@OBJECTIVES.register("bart")
class BartDenoising(TextObjective):
    """BART's denoising over windows of ``train.seq_len`` tokens; the decoder starts behind pad."""

    Options = BartOptions
    family = "encoder_decoder"

    def __init__(self, tokenizer, seq_len: int, stream, options: BartOptions) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        self.sentence_ends = sentence_end_ids(tokenizer)

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        tokenizer = self.tokenizer
        return bart_denoising(window, generator, mask_id=tokenizer.mask_id, pad_id=tokenizer.pad_id,
                              decoder_start_id=tokenizer.pad_id, sentence_end_ids=self.sentence_ends,
                              mask_ratio=self.options.mask_ratio, poisson_lambda=self.options.poisson_lambda)
