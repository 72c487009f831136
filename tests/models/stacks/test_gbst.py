"""Charformer's GBST (xscale/models/stacks/gbst.py): sec. 2.1 position by position and block size by block size
(outputs and gradients, with and without calibration, padded), padding that changes no class logit, a tiny byte
classifier and a byte MLM encoder that learn, the options refused."""

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.stacks.gbst import GBSTOptions, GradientBasedSubwordTokenization
from xscale.parallel.loss import model_loss_sum

VOCAB = 40
CLASSIFIER = ["model.family=encoder", "model.position=learned", "model.n_layers=2", "train.task=classify",
              "data.dataset=lra_retrieval", "model.vocab_size=272", "model.pooling=mean", "model.stack=gbst",
              "model.max_seq_len=16", "train.seq_len=16"]



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

def loop_reference(gbst: GradientBasedSubwordTokenization, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, length, _ = x.shape
    out = []
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t]]
        blocks = {}
        for size in range(1, gbst.max_block_size + 1):
            for i in range(length):
                start = i // size * size
                rows = [t for t in range(start, min(start + size, length)) if t in real]
                blocks[size, i] = sum(x[b, t] for t in rows) / max(len(rows), 1) if rows else x.new_zeros(x.shape[-1])
        sizes = range(1, gbst.max_block_size + 1)
        probs = [torch.stack([gbst.score(blocks[s, i])[0] for s in sizes]).softmax(0) for i in range(length)]
        if gbst.calibration:
            calibrated = []
            for i in range(length):
                affinity = torch.stack([probs[i] @ probs[j] for j in real]).softmax(0)
                calibrated.append(sum(a * probs[j] for a, j in zip(affinity, real)))
            probs = calibrated
        latent = [sum(probs[i][s - 1] * blocks[s, i] for s in sizes) for i in range(length)]
        pooled = []
        for start in range(0, length, gbst.downsample_rate):
            rows = [t for t in range(start, min(start + gbst.downsample_rate, length)) if t in real]
            pooled.append(sum(latent[t] for t in rows) / len(rows) if rows else x.new_zeros(x.shape[-1]))
        out.append(torch.stack(pooled))
    return torch.stack(out)


@pytest.mark.parametrize("calibration", [True, False], ids=["calibrated", "plain"])
def test_matches_the_loop_reference(calibration: bool) -> None:
    torch.manual_seed(0)
    gbst = GradientBasedSubwordTokenization(6, GBSTOptions(max_block_size=3, downsample_rate=2,
                                                           calibration=calibration)).double()
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out, pooled_mask = gbst(x, mask)
    ref = loop_reference(gbst, x, mask)
    assert pooled_mask.tolist() == [[True] * 4, [True, True, False, False]]
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    inputs = (x, *gbst.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want)


def _model(num_classes: int, downsample_rate: int) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=num_classes, pooling="mean",
                         stack=Component("gbst", {"max_block_size": 3, "downsample_rate": downsample_rate}))
    return build_model(config, seed=0)


def test_padding_changes_no_class_logit() -> None:
    model = _model(2, 2).eval()
    tokens = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    junk = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), torch.zeros(3, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        expected = model(tokens, padding_mask=torch.ones(3, 6, dtype=torch.bool))
        got = model(torch.cat([tokens, junk], dim=1), padding_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_classes,downsample_rate", [(2, 2), (0, 1)], ids=["classifier", "mlm"])
def test_a_tiny_byte_model_learns(num_classes: int, downsample_rate: int) -> None:
    """Classifier: the first byte's parity; MLM (no downsampling): the input bytes back; one batch, AdamW."""
    torch.manual_seed(0)
    model = _model(num_classes, downsample_rate).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(1, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens[:, 0] % 2 if num_classes else tokens}
    losses = []
    for _ in range(16):
        loss = model_loss_sum(model, batch) / tokens.numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "model.pooling=mean"], "set it to 1 or train.task=classify"),
    (["train.task=lm", "model.family=decoder", "model.stack.options.downsample_rate=1"], "set model.family=encoder"),
    (["model.pooling=cls"], "set model.pooling=mean or max"),
    (["model.stack.options.max_block_size=0"], "must be >= 1"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*CLASSIFIER, *overrides])
