"""GPT-2 (Radford et al. 2019): pre-LN, learned positions, GELU (tanh), biases, tied embeddings.

HF's ``Conv1D`` stores weights as (in, out) and fuses q, k, v into ``attn.c_attn``.
"""

from __future__ import annotations

from typing import Any

from xscale.config.schema import ModelConfig
from xscale.interop.hf.rules import Family, InteropError, Rule, fused, norm_eps, require, same, transposed

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise InteropError(f"config.json activation_function={activation!r} has no xscale equivalent "
                           f"(xscale supports {', '.join(ACTIVATIONS)})")
    require(hf, "scale_attn_weights", (True,), True)
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
    d_model = hf.get("n_embd", 768)
    return {
        "family": "decoder", "vocab_size": hf.get("vocab_size", 50257), "d_model": d_model,
        "n_layers": hf.get("n_layer", 12), "n_heads": hf.get("n_head", 12), "n_kv_heads": None,
        "d_ff": hf.get("n_inner") or 4 * d_model, "max_seq_len": hf.get("n_positions", 1024), "position": "learned",
        "norm": {"kind": "layernorm", "options": {"eps": hf.get("layer_norm_epsilon", 1e-5)}}, "norm_placement": "pre",
        "embedding_norm": False, "ffn": ACTIVATIONS[activation], "bias": True, "tie_embeddings": True,
        "lm_head_transform": False, "lm_head_bias": False, "dropout": hf.get("resid_pdrop", 0.0),
        "attention_dropout": hf.get("attn_pdrop", 0.0),
    }


def config_to_hf(model: ModelConfig) -> dict[str, Any]:
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[model.ffn.kind]
    special = 50256 if model.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": model.vocab_size,
        "n_embd": model.d_model, "n_layer": model.n_layers, "n_head": model.n_heads, "n_inner": model.ffn_hidden,
        "n_positions": model.max_seq_len, "activation_function": activation, "layer_norm_epsilon": norm_eps(model),
        "resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": model.attention_dropout,
        "tie_word_embeddings": True, "bos_token_id": special, "eos_token_id": special,
    }


def rules(model: ModelConfig) -> list[Rule]:
    out = [same("transformer.wte.weight", "embedding.weight"), same("transformer.wpe.weight", "stack.position.weight"),
           same("transformer.ln_f.weight", "stack.final_norm.weight"),
           same("transformer.ln_f.bias", "stack.final_norm.bias")]
    for i in range(model.n_layers):
        hf, attention, ffn = f"transformer.h.{i}.", f"stack.layers.{i}.attention.", f"stack.layers.{i}.feed_forward."
        qkv = tuple(f"{attention}sublayer.{name}" for name in ("wq", "wk", "wv"))
        out += [fused(hf + "attn.c_attn.weight", tuple(f"{name}.weight" for name in qkv), transpose=True),
                fused(hf + "attn.c_attn.bias", tuple(f"{name}.bias" for name in qkv)),
                transposed(hf + "attn.c_proj.weight", attention + "sublayer.wo.weight"),
                same(hf + "attn.c_proj.bias", attention + "sublayer.wo.bias"),
                transposed(hf + "mlp.c_fc.weight", ffn + "sublayer.w_in.weight"),
                same(hf + "mlp.c_fc.bias", ffn + "sublayer.w_in.bias"),
                transposed(hf + "mlp.c_proj.weight", ffn + "sublayer.w_out.weight"),
                same(hf + "mlp.c_proj.bias", ffn + "sublayer.w_out.bias")]
        for hf_norm, ours in (("ln_1", attention), ("ln_2", ffn)):
            out += [same(f"{hf}{hf_norm}.{kind}", f"{ours}norm.{kind}") for kind in ("weight", "bias")]
    return out


GPT2 = Family(
    model_type="gpt2", architecture="GPT2LMHeadModel", auto_class="AutoModelForCausalLM", base_prefix="transformer.",
    requires={"family": ("decoder",), "position.kind": ("learned",), "norm.kind": ("layernorm",), "norm_placement": ("pre",),
              "embedding_norm": (False,), "ffn.kind": ("gelu_tanh", "gelu", "relu"), "bias": (True,),
              "tie_embeddings": (True,), "lm_head_transform": (False,), "lm_head_bias": (False,),
              "n_kv_heads": (None,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
)
