"""The NSP / SOP head (BERT's pooler and a binary classifier on the first token): its shape, and the training loss
(MLM plus each example's pair cross-entropy weighted by its masked tokens) against a reference, by example."""

import torch
import torch.nn.functional as F

from xscale.config.schema import ModelConfig
from xscale.data.objectives import IGNORE_INDEX
from xscale.models import build_model
from xscale.parallel.loss import model_loss_sum

VOCAB, LENGTH, D = 40, 12, 16


def _model() -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=D, n_layers=1, n_heads=2, max_seq_len=LENGTH,
                         position="learned", objective_head="sentence_pair")
    return build_model(config, seed=0)


def test_two_logits_per_example():
    assert _model().objective_head(torch.randn(3, LENGTH, D)).shape == (3, 2)


def test_loss_matches_the_reference():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, VOCAB, (3, LENGTH), generator=generator)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[0, [2, 5]], labels[1, [1, 4, 8]], labels[2, 9] = 7, 8, 9  # 2, 3 and 1 masked tokens
    batch = {"input_ids": input_ids, "labels": labels, "pair_label": torch.tensor([0, 1, 1])}
    model = _model()
    loss = model_loss_sum(model, batch)
    hidden = model(input_ids, project=False)
    head = model.objective_head
    reference = torch.zeros(())
    for row in range(3):
        logits = hidden[row] @ model.output.weight.T
        masked = labels[row] != IGNORE_INDEX
        reference = reference + F.cross_entropy(logits[masked], labels[row][masked], reduction="sum")
        pooled = torch.tanh(head.pooler.weight @ hidden[row, 0] + head.pooler.bias)
        pair_logits = head.classifier.weight @ pooled + head.classifier.bias
        reference = reference + int(masked.sum()) * F.cross_entropy(pair_logits, batch["pair_label"][row])
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
