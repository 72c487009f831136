"""Llama (Touvron et al. 2023): pre-RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head by default.

HF's RoPE rotates the halves of each head (``rotate_half``: pairs (i, i + d/2)), as xscale's does, so q and k
weights cross unpermuted. One ``bias`` setting in xscale covers HF's ``attention_bias`` and ``mlp_bias``.
"""

from __future__ import annotations

from typing import Any

from xscale.config.schema import ModelConfig
from xscale.interop.hf.rules import Family, InteropError, Rule, linear, norm_eps, require, rope_theta, same


def _rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 nests RoPE in ``rope_parameters``; 4.x had ``rope_theta`` and ``rope_scaling``."""
    parameters = hf.get("rope_parameters") or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default" or hf.get("rope_scaling"):
        raise InteropError(f"config.json RoPE scaling {hf.get('rope_scaling') or rope_type!r} has no xscale "
                           "equivalent (xscale supports plain RoPE, rope_type 'default')")
    return float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    require(hf, "hidden_act", ("silu",), "silu")
    bias = require(hf, "attention_bias", (False, True), False)
    if hf.get("mlp_bias", False) != bias:
        raise InteropError(f"config.json attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} has no xscale "
                           "equivalent (model.bias sets both)")
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise InteropError(f"config.json head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
                           f"{d_model // n_heads}; xscale derives the head size from d_model/n_heads")
    kv_heads = hf.get("num_key_value_heads") or n_heads
    return {
        "family": "decoder", "vocab_size": hf.get("vocab_size", 32000), "d_model": d_model,
        "n_layers": hf.get("num_hidden_layers", 32), "n_heads": n_heads,
        "n_kv_heads": None if kv_heads == n_heads else kv_heads, "d_ff": hf.get("intermediate_size", 11008),
        "max_seq_len": hf.get("max_position_embeddings", 2048), "position": {"kind": "rope", "options": {"theta": _rope_theta(hf)}},
        "norm": {"kind": "rmsnorm", "options": {"eps": hf.get("rms_norm_eps", 1e-6)}}, "norm_placement": "pre",
        "embedding_norm": False, "ffn": "swiglu", "bias": bias, "tie_embeddings": hf.get("tie_word_embeddings", False),
        "lm_head_transform": False, "lm_head_bias": False, "dropout": 0.0,
        "attention_dropout": hf.get("attention_dropout", 0.0),
    }


def config_to_hf(model: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "intermediate_size": model.ffn_hidden,
        "max_position_embeddings": model.max_seq_len, "hidden_act": "silu", "rms_norm_eps": norm_eps(model),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta(model)}, "rope_theta": rope_theta(model),
        "attention_bias": model.bias, "mlp_bias": model.bias, "attention_dropout": model.attention_dropout,
        "tie_word_embeddings": model.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
    }


def rules(model: ModelConfig) -> list[Rule]:
    out = [same("model.embed_tokens.weight", "embedding.weight"), same("model.norm.weight", "stack.final_norm.weight")]
    if not model.tie_embeddings:
        out.append(same("lm_head.weight", "output.weight"))
    for i in range(model.n_layers):
        hf, ours = f"model.layers.{i}.", f"stack.layers.{i}."
        for hf_name, name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
            out += linear(f"{hf}self_attn.{hf_name}", f"{ours}attention.sublayer.{name}", model.bias)
        for hf_name, name in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            out += linear(f"{hf}mlp.{hf_name}", f"{ours}feed_forward.sublayer.{name}", model.bias)
        out += [same(hf + "input_layernorm.weight", ours + "attention.norm.weight"),
                same(hf + "post_attention_layernorm.weight", ours + "feed_forward.norm.weight")]
    return out


LLAMA = Family(
    model_type="llama", architecture="LlamaForCausalLM", auto_class="AutoModelForCausalLM", base_prefix="model.",
    requires={"family": ("decoder",), "position.kind": ("rope",), "norm.kind": ("rmsnorm",), "norm_placement": ("pre",),
              "embedding_norm": (False,), "ffn.kind": ("swiglu",), "lm_head_transform": (False,),
              "lm_head_bias": (False,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
)
