"""The stack tests' shared setup: one intra-op thread, and the tiny classifier each stack kind is tried as (its
model, its config's command-line overrides, a batch it can learn, the loop that trains it, padded inputs)."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import Component, ModelConfig
from xscale.models import build_model
from xscale.parallel.loss import model_loss_sum


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyClassifier:
    """An encoder classifier of 2 blocks of width 16 over a vocabulary of ``vocab`` (mean pooling, learned
    positions, 16 positions at most), with a given ``model.stack``."""

    vocab = 40

    def model(self, stack: Component, num_classes: int = 2, **options) -> torch.nn.Module:
        config = ModelConfig(family="encoder", vocab_size=self.vocab, d_model=16, n_layers=2, n_heads=2,
                             max_seq_len=16, position="learned", num_classes=num_classes, pooling="mean", stack=stack,
                             **options)
        return build_model(config, seed=0)

    @staticmethod
    def overrides(kind: str, *extra: str) -> list[str]:
        """The command-line overrides of such a classifier on the LRA retrieval bytes (train.seq_len 16)."""
        return ["model.family=encoder", "model.position=learned", "model.n_layers=2", "train.task=classify",
                "data.dataset=lra_retrieval", "model.vocab_size=272", "model.pooling=mean", f"model.stack={kind}",
                "model.max_seq_len=16", "train.seq_len=16", *extra]

    def parity_batch(self, labels_are_tokens: bool = False) -> dict[str, torch.Tensor]:
        """16 sequences of 8 tokens; class = the first token's parity (or, ``labels_are_tokens``, the tokens back)."""
        tokens = torch.randint(1, self.vocab, (16, 8), generator=torch.Generator().manual_seed(0))
        return {"input_ids": tokens, "labels": tokens if labels_are_tokens else tokens[:, 0] % 2}

    @staticmethod
    def train(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int, divisor: int) -> list[float]:
        """The losses (sum / ``divisor``) of ``steps`` AdamW steps (lr 1e-2) on ``batch``."""
        torch.manual_seed(0)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            loss = model_loss_sum(model, batch) / divisor
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def padded_logits(self, model: torch.nn.Module, length: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The class logits of 3 sequences of ``length`` tokens, unpadded and followed by ``padding`` junk tokens
        under the padding mask."""
        tokens = torch.randint(1, self.vocab, (3, length), generator=torch.Generator().manual_seed(0))
        junk = torch.randint(1, self.vocab, (3, padding), generator=torch.Generator().manual_seed(1))
        mask = torch.cat([torch.ones(3, length, dtype=torch.bool), torch.zeros(3, padding, dtype=torch.bool)], dim=1)
        model.eval()
        with torch.no_grad():
            return (model(tokens, padding_mask=torch.ones(3, length, dtype=torch.bool)),
                    model(torch.cat([tokens, junk], dim=1), padding_mask=mask))


@pytest.fixture
def tiny_classifier() -> TinyClassifier:
    return TinyClassifier()
