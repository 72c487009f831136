"""SpanBERT's span-boundary head (Joshi et al. 2020, eq. 1-2): its output shape, and the training loss (MLM plus
SBO through the shared output embedding) and its gradients against a token-by-token reference."""

import torch
import torch.nn.functional as F

from xscale.config.schema import Component, ModelConfig
from xscale.data.datasets import collate
from xscale.data.objectives import IGNORE_INDEX, geometric_span_masking
from xscale.models import build_model
from xscale.parallel.loss import model_loss_sum

VOCAB, LENGTH, D = 40, 16, 16


def _model(relative_positions: int = 32) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=D, n_layers=1, n_heads=2, max_seq_len=LENGTH,
                         position="learned",
                         objective_head=Component("span_boundary", {"relative_positions": relative_positions}))
    return build_model(config, seed=0)


def _batch() -> dict[str, torch.Tensor]:
    samples = []
    for seed in range(2):
        tokens = torch.randint(5, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(seed))
        samples.append(geometric_span_masking(tokens, torch.Generator().manual_seed(seed), vocab_size=VOCAB,
                                              mask_id=1, special_ids=[0, 1, 2, 3], mask_probability=0.3))
    return collate(samples)


def _reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over masked tokens of CE(x_i E^T) + CE(y_i E^T), y_i from the boundary states, token by token."""
    head, embedding = model.objective_head, model.output.weight
    hidden = model(batch["input_ids"], project=False)
    total = torch.zeros(())
    for row, position in torch.nonzero(batch["labels"] != IGNORE_INDEX).tolist():
        label = batch["labels"][row, position]
        total = total + F.cross_entropy(hidden[row, position] @ embedding.T, label)
        left, right = hidden[row, batch["span_left"][row, position]], hidden[row, batch["span_right"][row, position]]
        offset = min(int(batch["span_offset"][row, position]), head.relative_positions)
        h0 = torch.cat([left, right, head.position.weight[offset - 1]])
        h1 = F.layer_norm(F.gelu(head.dense1.weight @ h0 + head.dense1.bias), (D,), head.norm1.weight, head.norm1.bias)
        y = F.layer_norm(F.gelu(head.dense2.weight @ h1 + head.dense2.bias), (D,), head.norm2.weight, head.norm2.bias)
        total = total + F.cross_entropy(y @ embedding.T, label)
    return total


def test_the_head_predicts_one_state_per_target():
    model, hidden = _model(), torch.randn(2, LENGTH, D)
    pairs = torch.tensor([[0, 3], [1, 7], [1, 10]])
    out = model.objective_head(hidden, pairs, pairs + torch.tensor([0, 4]), torch.tensor([1, 2, 40]))
    assert out.shape == (3, D)


def test_loss_and_gradients_match_the_token_by_token_reference():
    batch = _batch()
    for relative_positions in (32, 2):  # 2: longer spans reuse the last relative position
        model = _model(relative_positions)
        loss = model_loss_sum(model, batch)
        loss.backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        model.zero_grad()
        reference = _reference_loss(model, batch)
        reference.backward()
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
        assert grads["objective_head.dense1.weight"].abs().sum() > 0
