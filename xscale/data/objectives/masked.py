"""Masked language modelling with BERT's 80/10/10 rule (Devlin et al. 2019, sec. 3.1), and the masking options the
BERT-style objectives share (mlm, nsp, sop, electra; SpanBERT adds its span lengths)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from xscale.config.schema import ConfigError
from xscale.data.objectives.registry import IGNORE_INDEX, OBJECTIVES, Sample, TextObjective


@dataclasses.dataclass
class MaskingOptions:
    mask_probability: float = dataclasses.field(default=0.15, metadata={
        "help": "the fraction of the maskable tokens chosen for the loss (BERT: 15%)"})

    def __post_init__(self) -> None:
        if not 0 < self.mask_probability <= 0.5:
            raise ConfigError(f"train.objective.options.mask_probability={self.mask_probability} (the masked fraction) "
                              "must be in (0, 0.5]")


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
    inputs[replace_with_random] = random_ordinary_tokens(len(replace_with_random), vocab_size, special, generator)
    return {"input_ids": inputs, "labels": labels}


def random_ordinary_tokens(count: int, vocab_size: int, special: torch.Tensor, generator: torch.Generator
                           ) -> torch.Tensor:
    """``count`` tokens drawn uniformly from the vocabulary less its special tokens."""
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[special[special < vocab_size]] = False
    pool = torch.nonzero(ordinary).flatten()
    return pool[torch.randint(len(pool), (count,), generator=generator)]


def masking_arguments(tokenizer, options: MaskingOptions) -> dict:
    """The keyword arguments every BERT-style masking takes from the tokenizer and the options."""
    return {"vocab_size": tokenizer.vocab_size, "mask_id": tokenizer.mask_id, "special_ids": tokenizer.special_ids,
            "mask_probability": options.mask_probability}


@OBJECTIVES.register("mlm")
class MaskedLM(TextObjective):
    """BERT's masked LM over windows of ``train.seq_len`` tokens."""

    Options = MaskingOptions
    text_only = False

    def __init__(self, tokenizer, seq_len: int, stream, options: MaskingOptions) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        self.arguments = masking_arguments(tokenizer, options)

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        return masked_lm(window, generator, **self.arguments)
