"""BERT (Devlin et al. 2019) with its masked-LM head: post-LN, learned positions plus an embedding LayerNorm, GELU,
the head transform (dense, GELU, LayerNorm) and a vocabulary bias, tied embeddings.

xscale has no segment (token type) input: segment 0's embedding is folded into the position table on import, exact
for single-segment inputs (HF's default ``token_type_ids``), and exported as zeros beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from xscale.config.schema import ModelConfig
from xscale.interop.hf.rules import Family, Rule, linear, norm_eps, require, same

EMBEDDINGS = "bert.embeddings."
TYPE_VOCAB_SIZE = 2


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    require(hf, "hidden_act", ("gelu",), "gelu")
    require(hf, "position_embedding_type", ("absolute",), "absolute")
    require(hf, "is_decoder", (False,), False)
    return {
        "family": "encoder", "vocab_size": hf.get("vocab_size", 30522), "d_model": hf.get("hidden_size", 768),
        "n_layers": hf.get("num_hidden_layers", 12), "n_heads": hf.get("num_attention_heads", 12),
        "n_kv_heads": None, "d_ff": hf.get("intermediate_size", 3072),
        "max_seq_len": hf.get("max_position_embeddings", 512), "position": "learned",
        "norm": {"kind": "layernorm", "options": {"eps": hf.get("layer_norm_eps", 1e-12)}}, "norm_placement": "post", "embedding_norm": True,
        "ffn": "gelu", "bias": True, "tie_embeddings": True, "lm_head_transform": True, "lm_head_bias": True,
        "dropout": hf.get("hidden_dropout_prob", 0.0), "attention_dropout": hf.get("attention_probs_dropout_prob", 0.0),
    }


def config_to_hf(model: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "intermediate_size": model.ffn_hidden, "max_position_embeddings": model.max_seq_len, "hidden_act": "gelu",
        "layer_norm_eps": norm_eps(model), "type_vocab_size": TYPE_VOCAB_SIZE,
        "hidden_dropout_prob": model.dropout, "attention_probs_dropout_prob": model.attention_dropout,
        "tie_word_embeddings": True, "pad_token_id": 0,
    }


def _fold_segment(position: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor]:
    return (position + segments[0],)


def _unfold_segment(position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return position, position.new_zeros(TYPE_VOCAB_SIZE, position.shape[1])


def rules(model: ModelConfig) -> list[Rule]:
    head = "cls.predictions."
    out = [same(EMBEDDINGS + "word_embeddings.weight", "embedding.weight"),
           Rule((EMBEDDINGS + "position_embeddings.weight", EMBEDDINGS + "token_type_embeddings.weight"),
                ("stack.position.weight",), _fold_segment, _unfold_segment),
           same(EMBEDDINGS + "LayerNorm.weight", "embedding_norm.weight"),
           same(EMBEDDINGS + "LayerNorm.bias", "embedding_norm.bias"),
           *linear(head + "transform.dense", "head_transform.dense", bias=True),
           *linear(head + "transform.LayerNorm", "head_transform.norm", bias=True),
           same(head + "bias", "output.bias")]
    for i in range(model.n_layers):
        hf, ours = f"bert.encoder.layer.{i}.", f"stack.layers.{i}."
        pairs = {"attention.self.query": "attention.sublayer.wq", "attention.self.key": "attention.sublayer.wk",
                 "attention.self.value": "attention.sublayer.wv", "attention.output.dense": "attention.sublayer.wo",
                 "attention.output.LayerNorm": "attention.norm", "intermediate.dense": "feed_forward.sublayer.w_in",
                 "output.dense": "feed_forward.sublayer.w_out", "output.LayerNorm": "feed_forward.norm"}
        for hf_name, name in pairs.items():
            out += linear(hf + hf_name, ours + name, bias=True)
    return out


BERT = Family(
    model_type="bert", architecture="BertForMaskedLM", auto_class="AutoModelForMaskedLM", base_prefix="bert.",
    requires={"family": ("encoder",), "position.kind": ("learned",), "norm.kind": ("layernorm",), "norm_placement": ("post",),
              "embedding_norm": (True,), "ffn.kind": ("gelu",), "bias": (True,), "tie_embeddings": (True,),
              "lm_head_transform": (True,), "lm_head_bias": (True,), "n_kv_heads": (None,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
)
