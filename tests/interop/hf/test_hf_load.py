"""Import: tiny random HF GPT-2, Llama (GQA) and BERT read into xscale give HF's logits (fp32, 1e-5)."""

import pytest
import torch

from xscale.interop.hf.load import hf_model_config, load_hf, model_config_from_hf, state_dict_from_hf
from xscale.interop.hf.rules import InteropError
from xscale.models import build_model

pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")
from hf_models import build, hf_logits, save, tokens, xscale_logits  # noqa: E402


def _xscale_model(config, state):
    model = build_model(config, "cpu", seed=0)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_imported_logits_equal_huggingface(tmp_path, kind):
    hf = save(kind, tmp_path)
    config, state = load_hf(tmp_path)
    ours = _xscale_model(config, state)
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(xscale_logits(ours, batch), hf_logits(hf, batch), atol=1e-5, rtol=1e-5)


def test_llama_keeps_grouped_query_attention_and_an_untied_head(tmp_path):
    save("llama", tmp_path)
    config = hf_model_config(tmp_path)
    assert (config.n_heads, config.kv_heads, config.tie_embeddings, config.position.options) == (4, 2, False, {"theta": 5000.0})


def test_overrides_apply_on_top_of_config_json(tmp_path):
    save("gpt2", tmp_path)
    assert hf_model_config(tmp_path, {"dropout": 0.1, "attention": {"kind": "dense"}}).dropout == 0.1


def test_in_memory_state_dict_converts_too():
    hf = build("llama")
    config = model_config_from_hf(hf.config.to_dict())
    ours = _xscale_model(config, state_dict_from_hf(hf.state_dict(), config, "llama"))
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(xscale_logits(ours, batch), hf_logits(hf, batch), atol=1e-5, rtol=1e-5)


def test_unsupported_hf_settings_are_refused_naming_them(tmp_path):
    save("llama", tmp_path, hidden_act="gelu")
    with pytest.raises(InteropError, match="hidden_act"):
        hf_model_config(tmp_path)
    with pytest.raises(InteropError, match="config.json is missing"):
        hf_model_config(tmp_path / "nowhere")


def test_t5_v1_1_unscaled_head_is_refused(tmp_path):
    save("t5", tmp_path, tie_word_embeddings=False)  # transformers 5: tied, decoder output not scaled
    with pytest.raises(InteropError, match="scale_decoder_outputs"):
        hf_model_config(tmp_path)
