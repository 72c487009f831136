"""Sequence classification: padded tokens change neither the class logits nor the real tokens' states, for every
attention kind that takes a key-padding mask; the others are refused for padded batches."""

import pytest
import torch

from xscale.config.load import load_config_from_cli
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.attention.core import padding_mask_kinds
from xscale.models.heads.classifier import pool
from xscale.models.registry import ATTENTION

VOCAB, REAL, PADDED = 40, 5, 11


def _model(kind: str = "dense", pooling: str = "mean", num_classes: int = 3) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=num_classes, pooling=pooling,
                         attention=AttentionConfig(kind=kind))
    return build_model(config, seed=0).eval()


def _padded(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` followed by random junk (not the pad id: only the mask may hide it) and the mask of the real ones."""
    junk = torch.randint(1, VOCAB, (tokens.shape[0], PADDED - REAL), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([torch.ones_like(tokens, dtype=torch.bool), torch.zeros_like(junk, dtype=torch.bool)], dim=1)
    return torch.cat([tokens, junk], dim=1), mask


TOKENS = torch.randint(1, VOCAB, (3, REAL), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", padding_mask_kinds())
def test_padding_changes_no_class_logit(kind):
    model = _model(kind)
    padded, mask = _padded(TOKENS)
    with torch.no_grad():
        expected = model(TOKENS, padding_mask=torch.ones_like(TOKENS, dtype=torch.bool))
        got = model(padded, padding_mask=mask)
        unmasked = model(padded)
    assert expected.shape == (3, 3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, expected, atol=1e-3), "the junk must matter when the mask is ignored"


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_pooling_reads_no_padded_row(pooling):
    model = _model(pooling=pooling)
    padded, mask = _padded(TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, padding_mask=mask), model(TOKENS), rtol=1e-5, atol=1e-5)


def test_language_model_real_tokens_ignore_the_padding():
    model = _model(num_classes=0)
    padded, mask = _padded(TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, padding_mask=mask)[:, :REAL], model(TOKENS), rtol=1e-5, atol=1e-5)


def test_masked_mean_pooling_is_the_mean_of_the_real_rows():
    hidden = torch.arange(12, dtype=torch.float32).view(1, 4, 3)
    mask = torch.tensor([[True, True, False, False]])
    torch.testing.assert_close(pool(hidden, mask, "mean"), hidden[:, :2].mean(dim=1))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])


def test_masked_max_pooling_is_the_max_of_the_real_rows():
    hidden = torch.tensor([[[1.0, -5.0], [-2.0, -3.0], [9.0, 9.0]]])  # the padded last row holds the largest values
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(pool(hidden, mask, "max"), torch.tensor([[1.0, -3.0]]))
    torch.testing.assert_close(pool(hidden, None, "max"), torch.tensor([[9.0, 9.0]]))


def _unable_kind() -> str:
    able = set(padding_mask_kinds())
    return next(name for name in ("linear", "performer", "nystrom") if name in ATTENTION and name not in able)


def test_a_core_without_padding_mask_is_refused_for_padded_batches():
    kind = _unable_kind()
    model = _model(kind)
    padded, mask = _padded(TOKENS)
    core_name = type(model.stack.layers["0"].attention.sublayer.core).__name__
    with pytest.raises(ValueError, match=f"{core_name} takes no key-padding mask"):
        model(padded, padding_mask=mask)
    model(TOKENS)  # unpadded batches still run


def test_classify_config_refuses_a_core_without_padding_mask():
    kind = _unable_kind()
    with pytest.raises(ConfigError, match=f"attention '{kind}' takes no key-padding mask.*use one that does: "):
        load_config_from_cli(None, ["model.family=encoder", "train.task=classify", "data.dataset=labeled",
                                    "data.path=x.jsonl", f"model.attention.kind={kind}"])
