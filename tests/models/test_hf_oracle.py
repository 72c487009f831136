"""External oracles: GPT-2 and BERT from Hugging Face (randomly initialised locally, no download)
with weights copied into xscale's Transformer must give the same logits."""

import pytest
import torch

from xscale.models import build_model
from xscale.models.convert import bert_config, bert_state_dict, gpt2_config, gpt2_state_dict

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")


def _load(config, state):
    model = build_model(config, "cpu", seed=0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not missing, missing
    return model.eval()


def test_gpt2_logits_match_huggingface():
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=211, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    config = gpt2_config(hf_config)
    ours = _load(config, gpt2_state_dict(hf.state_dict(), config))
    tokens = torch.randint(0, 211, (2, 37))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_bert_mlm_logits_match_huggingface():
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(vocab_size=199, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=96, max_position_embeddings=64,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForMaskedLM(hf_config).eval()
    with torch.no_grad():  # HF zero-initialises some of these: randomise so the mapping is really checked
        for name, param in hf.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    config = bert_config(hf_config)
    ours = _load(config, bert_state_dict(hf.state_dict(), config))
    tokens = torch.randint(0, 199, (2, 29))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
