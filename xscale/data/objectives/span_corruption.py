"""T5's span corruption (Raffel et al. 2020, sec. 3.1.4): noise spans of the window each become one sentinel in the
encoder's input, and the decoder writes every span behind its sentinel."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from xscale.config.schema import ConfigError
from xscale.data.objectives.registry import OBJECTIVES, Sample, TextObjective


@dataclasses.dataclass
class SpanCorruptionOptions:
    noise_density: float = dataclasses.field(default=0.15, metadata={
        "help": "the fraction of each window's tokens in noise spans (T5: 15%)"})
    mean_span_length: float = dataclasses.field(default=3.0, metadata={"help": "the mean noise span length (T5: 3)"})

    def __post_init__(self) -> None:
        if not 0 < self.noise_density < 1:
            raise ConfigError(f"train.objective.options.noise_density={self.noise_density} (the corrupted fraction) "
                              "must be in (0, 1)")
        if not self.mean_span_length >= 1:
            raise ConfigError(f"train.objective.options.mean_span_length={self.mean_span_length} must be at least 1")


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


def random_partition(total: int, parts: int, generator: torch.Generator) -> torch.Tensor:
    """``parts`` positive integers summing to ``total``, uniformly over such compositions."""
    cuts = torch.randperm(total - 1, generator=generator)[:parts - 1] + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values, torch.tensor([total])])
    return bounds.diff()


def random_spans_noise_mask(length: int, generator: torch.Generator, noise_density: float = 0.15,
                            mean_span_length: float = 3.0) -> torch.Tensor:
    """Boolean mask of noise positions: ``spans`` noise runs interleaved with as many kept runs, kept first."""
    noise, spans = span_lengths(length, noise_density, mean_span_length)
    noise_runs = random_partition(noise, spans, generator)
    kept_runs = random_partition(length - noise, spans, generator)
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


@OBJECTIVES.register("span")
class SpanCorruption(TextObjective):
    """T5's span corruption over windows of ``train.seq_len`` tokens; the decoder starts behind pad."""

    Options = SpanCorruptionOptions
    family, text_only = "encoder_decoder", False

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        tokenizer = self.tokenizer
        return span_corruption(window, generator, sentinel_ids=tokenizer.sentinel_ids, eos_id=tokenizer.eos_id,
                               decoder_start_id=tokenizer.pad_id, noise_density=self.options.noise_density,
                               mean_span_length=self.options.mean_span_length)
