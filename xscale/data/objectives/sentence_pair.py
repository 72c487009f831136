"""The sentence pairs of BERT's next-sentence prediction (Devlin et al. 2019, sec. 3.1) and ALBERT's sentence-order
prediction (Lan et al. 2020, sec. 4.1); the head that reads the pair's label is
:mod:`xscale.models.heads.sentence_pair`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from xscale.data.objectives.masked import MaskingOptions, masked_lm, masking_arguments
from xscale.data.objectives.registry import OBJECTIVES, Sample, TextObjective, TokenStream

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


class SentencePair(TextObjective):
    """[CLS] A [SEP] B [SEP] from windows of ``train.seq_len`` - 3 tokens (bos as [CLS], eos as [SEP]); trains
    ``model.objective_head=sentence_pair``."""

    Options = MaskingOptions
    head = "sentence_pair"
    kind = ""

    def __init__(self, tokenizer, seq_len: int, stream: TokenStream | None, options: MaskingOptions) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        if tokenizer.bos_id is None:
            raise ValueError(f"train.objective={self.kind} starts each pair with bos as [CLS], but the tokenizer has "
                             "no bos token; use a tokenizer trained by xscale (xscale data tokenizer)")
        self.window_length, self.stream = seq_len - 3, stream
        self.arguments = masking_arguments(tokenizer, options)

    def random_segment(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` tokens read at a uniform place of the corpus."""
        start = int(torch.randint(len(self.stream) - count + 1, (1,), generator=generator))
        return torch.from_numpy(np.asarray(self.stream.read(start, start + count), dtype=np.int64))

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        return sentence_pair(window, generator, kind=self.kind, cls_id=self.tokenizer.bos_id,
                             sep_id=self.tokenizer.eos_id,
                             random_segment=self.random_segment if self.stream is not None else None, **self.arguments)


@OBJECTIVES.register("nsp")
class NextSentence(SentencePair):
    """BERT's next-sentence prediction: B is the text that follows A, or (half the time) a random segment."""

    kind = "nsp"


@OBJECTIVES.register("sop")
class SentenceOrder(SentencePair):
    """ALBERT's sentence-order prediction: A then B, or (half the time) B then A."""

    kind = "sop"
