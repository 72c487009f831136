"""The sentence-pair head of BERT's next-sentence prediction (Devlin et al. 2019, sec. 3.1, task 2) and ALBERT's
sentence-order prediction (Lan et al. 2020, sec. 3.2): a binary classifier on the first token's final state,
through BERT's pooler, logits = W tanh(W_p h_[CLS] + b_p) + b.

The training loss is L_MLM + L_pair. Engines divide the summed loss by the labelled (masked) tokens, so each
example's pair cross-entropy is weighted by its own count of masked tokens n_b: the total is
(sum MLM + sum_b n_b CE_b) / sum_b n_b, the mean MLM loss plus the mean pair loss (exactly when every example
masks as many tokens, as windows without special tokens do), and independent of how rows are split over ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.heads.objective import Batch, TokenLossSum
from xscale.models.registry import OBJECTIVE_HEAD, NoOptions


@OBJECTIVE_HEAD.register("sentence_pair")
class SentencePairHead(nn.Module):
    """Two logits per example from its first token (module docstring): 0 = the pair as the corpus has it, 1 = the
    second segment random (NSP) or the two segments swapped (SOP). Reads the batch's ``pair_label`` (B,)."""

    Options = NoOptions
    corrupts_inputs, adds_to_token_loss = False, True
    batch_keys = ("pair_label",)

    def __init__(self, config: ModelConfig, options: NoOptions) -> None:
        super().__init__()
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.classifier = nn.Linear(config.d_model, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, D) final states -> (B, 2) logits."""
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def loss_sum(self, hidden: torch.Tensor, batch: Batch, token_loss_sum: TokenLossSum) -> torch.Tensor:
        """sum_b n_b CE(logits_b, pair_label_b), n_b the masked tokens of example b (module docstring)."""
        masked = (batch["labels"] != -100).sum(dim=1).to(torch.float32)
        per_example = F.cross_entropy(self(hidden).float(), batch["pair_label"], reduction="none")
        return (masked * per_example).sum()
