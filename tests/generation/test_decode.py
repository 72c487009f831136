"""The decoding loop: the KV-cache path equals recomputing the prefix (tokens, and logits at 1e-5), matches Hugging
Face GPT-2's greedy generate, and non-caching cores decode through the recompute path."""

import pytest
import torch

from xscale.config.load import from_dict
from xscale.config.schema import ModelConfig
from xscale.generation import Sampling, decodes_with_cache, generate
from xscale.generation.decode import check_decoder
from xscale.interop.hf.load import model_config_from_hf, state_dict_from_hf
from xscale.models import build_model


def _model(**fields):
    config = from_dict(ModelConfig, {"family": "decoder", "vocab_size": 64, "d_model": 32, "n_layers": 2,
                                     "n_heads": 4, "max_seq_len": 40, **fields})
    return build_model(config, "cpu", seed=7).eval()


def _prompt(length=6, batch=1):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fields", [
    {"position": "rope"},
    {"position": "learned"},
    {"position": "alibi"},
    {"position": "rope", "n_kv_heads": 2},
    {"position": "alibi", "n_kv_heads": 1},
], ids=["rope", "learned", "alibi", "rope-gqa", "alibi-mqa"])
@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0.9, top_k=20, top_p=0.9)], ids=["greedy", "sampled"])
def test_cached_decoding_equals_recomputing_the_prefix(fields, sampling):
    model = _model(**fields)
    assert decodes_with_cache(model)
    prompt = _prompt(batch=2)
    cached = generate(model, prompt, 16, sampling, seed=3, use_cache=True)
    recomputed = generate(model, prompt, 16, sampling, seed=3, use_cache=False)
    assert cached.cached and not recomputed.cached
    assert cached.tokens.shape == (2, 16)
    assert torch.equal(cached.tokens, recomputed.tokens)
    torch.testing.assert_close(cached.logits, recomputed.logits, atol=1e-5, rtol=1e-5)
    assert len(set(cached.tokens.flatten().tolist())) > 1  # not a degenerate repetition that hides an offset


def test_first_logits_are_the_full_forward_at_the_last_prompt_position():
    model = _model(position="rope", n_kv_heads=2)
    prompt = _prompt()
    with torch.no_grad():
        expected = model(prompt)[:, -1]
    torch.testing.assert_close(generate(model, prompt, 1).logits[:, 0], expected, atol=1e-5, rtol=1e-5)


def test_a_core_that_cannot_cache_decodes_by_recomputing():
    model = _model(attention={"kind": "local", "options": {"window": 4, "block_size": 4}}, position="rope")
    assert not decodes_with_cache(model)
    prompt = _prompt()
    result = generate(model, prompt, 8)
    assert not result.cached and result.tokens.shape == (1, 8)
    sequence = torch.cat([prompt, result.tokens], dim=1)
    with torch.no_grad():  # each step's logits are one full forward's over the prefix before it (causal)
        expected = model(sequence[:, :-1])[:, prompt.shape[1] - 1:]
    torch.testing.assert_close(result.logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(result.tokens, expected.argmax(-1))
    with pytest.raises(ValueError, match="cannot decode from a KV cache"):
        generate(model, prompt, 2, use_cache=True)


def test_stops_at_eos_and_pads_finished_rows_with_it():
    model = _model(position="learned")
    prompt = _prompt(batch=2)
    free = generate(model, prompt, 10)
    eos = int(free.tokens[0, 2])  # row 0 reaches it at step 3
    stopped = generate(model, prompt, 10, eos_id=eos)
    row0 = stopped.tokens[0].tolist()
    assert row0[:3] == free.tokens[0, :3].tolist() and set(row0[3:]) <= {eos}
    if eos not in free.tokens[1].tolist():
        assert stopped.tokens.shape[1] == 10 and torch.equal(stopped.tokens[1], free.tokens[1])


def test_vocab_size_limits_the_ids_chosen():
    result = generate(_model(), _prompt(), 12, Sampling(1.0), vocab_size=10)
    assert int(result.tokens.max()) < 10


def test_refusals_name_what_to_change():
    model = _model()
    with pytest.raises(ValueError, match="max_seq_len=40"):
        check_decoder(model, 30, 11)
    with pytest.raises(ValueError, match="needs a decoder"):
        check_decoder(build_model(from_dict(ModelConfig, {"family": "encoder", "vocab_size": 64, "d_model": 32,
                                                          "n_layers": 1, "n_heads": 4}), "cpu"), 3, 1)


def test_greedy_generation_matches_huggingface_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    torch.manual_seed(0)
    # initializer_range 0.3 (HF: 0.02) so that attention, not the current token alone, decides the next token
    hf_config = transformers.GPT2Config(vocab_size=97, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    config = model_config_from_hf(hf_config.to_dict())
    ours = build_model(config, "cpu", seed=0)
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), config, "gpt2"))
    prompt = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
    result = generate(ours, prompt, 24, eos_id=0)  # both stop after eos (id 0), before the 24th token here
    assert result.cached and result.tokens.shape[1] < 24 and int(result.tokens[0, -1]) == 0
    assert result.tokens.tolist() == expected.sequences[:, prompt.shape[1]:].tolist()
    torch.testing.assert_close(result.logits, torch.stack(expected.logits, dim=1), atol=1e-4, rtol=1e-4)
