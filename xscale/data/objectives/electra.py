"""ELECTRA's masking for replaced-token detection (Clark et al. 2020, sec. 2); the generator and discriminator are
:mod:`xscale.models.heads.replaced_token_detection`. The discriminator's weight lambda (L = L_MLM + lambda L_Disc,
50) is the head's option ``model.objective_head.options.rtd_weight``, not this objective's: the head computes and
weighs both losses, and the model, built from ``model`` alone, cannot read ``train.objective`` (models sit below
data in the layers); ``train.objective.options.discriminator_weight`` or ``rtd_weight`` is refused with that key."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xscale.data.objectives.masked import MaskingOptions, masked_lm, masking_arguments
from xscale.data.objectives.registry import IGNORE_INDEX, OBJECTIVES, Sample, TextObjective


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


@OBJECTIVES.register("electra")
class Electra(TextObjective):
    """ELECTRA's masking over windows of ``train.seq_len`` tokens; trains
    ``model.objective_head=replaced_token_detection``."""

    Options = MaskingOptions
    head = "replaced_token_detection"
    options_elsewhere = {name: "model.objective_head.options.rtd_weight (ELECTRA's lambda is the head's)"
                         for name in ("discriminator_weight", "rtd_weight")}

    def __init__(self, tokenizer, seq_len: int, stream, options: MaskingOptions) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        self.arguments = masking_arguments(tokenizer, options)

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        return electra_masking(window, generator, **self.arguments)
