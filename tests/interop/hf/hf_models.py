"""Tiny random Hugging Face models built locally (no download) and saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def _randomise_zero_initialised(model: torch.nn.Module) -> None:
    """HF sets norms to 1 and biases to 0: randomise them so a swapped or dropped tensor shows in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny HF model of family ``kind`` (gpt2 | llama | bert | t5), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          rope_theta=5000.0, **overrides)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "t5":  # d_model 64 and d_kv 16: T5's folded scalings are powers of two (an exact round trip)
        config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=48, num_layers=2, num_heads=4,
                                       dropout_rate=0.0, **overrides)
        model = transformers.T5ForConditionalGeneration(config)
    elif kind == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **overrides)
        model = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(kind)
    _randomise_zero_initialised(model)
    return model.eval()


def save(kind: str, directory: Path, **overrides) -> torch.nn.Module:
    model = build(kind, **overrides)
    model.save_pretrained(directory)
    return model


def tokens(batch: int = 2, length: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decoder_tokens(batch: torch.Tensor) -> torch.Tensor:
    """Decoder inputs for an encoder-decoder: other tokens, of another length."""
    return tokens(batch.shape[0], batch.shape[1] - 4, seed=2)


def hf_logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if model.config.is_encoder_decoder:
        return model(input_ids=batch, decoder_input_ids=decoder_tokens(batch)).logits
    return model(batch).logits


def xscale_logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if model.config.family == "encoder_decoder":
        return model(batch, decoder_input_ids=decoder_tokens(batch))
    return model(batch)
