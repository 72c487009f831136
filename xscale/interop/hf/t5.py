"""T5 (Raffel et al. 2020), v1.0 layout: pre-RMSNorm, relative position buckets, ReLU FFN, no biases, tied head.

Two of T5's scalings are folded into the weights, exact in real arithmetic: its attention has no 1/sqrt(d_head)
(the query projection is stored x sqrt(d_head) here), and a tied head multiplies the decoder output by
d_model^-0.5 where xscale multiplies tied embeddings by sqrt(d_model) (the shared table is stored / sqrt(d_model)).
Both factors are powers of two for d_head = 64 and d_model = 4^k, where the round trip is bit-exact.
"""

from __future__ import annotations

import math
from typing import Any

from xscale.config.schema import ModelConfig
from xscale.interop.hf.rules import (
    Family,
    InteropError,
    Rule,
    norm_eps,
    position_options,
    require,
    same,
    scaled,
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    require(hf, "feed_forward_proj", ("relu",), "relu")
    # transformers 5 always ties the head and scales the decoder output unless a config said tie_word_embeddings=false
    # (T5 v1.1); xscale's tied encoder-decoder scales (x sqrt(d_model) on the embeddings), so only v1.0 maps.
    require(hf, "scale_decoder_outputs", (True,), hf.get("tie_word_embeddings", True) is not False)
    d_model, n_heads = hf.get("d_model", 512), hf.get("num_heads", 8)
    if hf.get("d_kv", d_model // n_heads) * n_heads != d_model:
        raise InteropError(f"config.json d_kv={hf.get('d_kv')} x num_heads={n_heads} differs from d_model={d_model}; "
                           "xscale derives the head size from d_model/n_heads")
    layers = hf.get("num_layers", 6)
    decoder_layers = hf.get("num_decoder_layers") or layers
    return {
        "family": "encoder_decoder", "vocab_size": hf.get("vocab_size", 32128), "d_model": d_model,
        "n_layers": layers, "n_decoder_layers": None if decoder_layers == layers else decoder_layers,
        "n_heads": n_heads, "n_kv_heads": None, "d_ff": hf.get("d_ff", 2048), "max_seq_len": hf.get("n_positions", 512),
        "position": {"kind": "t5_bias", "options": {"num_buckets": hf.get("relative_attention_num_buckets", 32),
                                                    "max_distance": hf.get("relative_attention_max_distance", 128)}},
        "norm": {"kind": "rmsnorm", "options": {"eps": hf.get("layer_norm_epsilon", 1e-6)}}, "norm_placement": "pre",
        "embedding_norm": False, "ffn": "relu", "bias": False, "tie_embeddings": True,
        "lm_head_transform": False, "lm_head_bias": False, "dropout": hf.get("dropout_rate", 0.0),
        "attention_dropout": hf.get("dropout_rate", 0.0),
    }


def config_to_hf(model: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": model.vocab_size,
        "d_model": model.d_model, "d_kv": model.head_dim, "d_ff": model.ffn_hidden, "num_layers": model.n_layers,
        "num_decoder_layers": model.decoder_layers, "num_heads": model.n_heads, "feed_forward_proj": "relu",
        "relative_attention_num_buckets": position_options(model).num_buckets,
        "relative_attention_max_distance": position_options(model).max_distance,
        "layer_norm_epsilon": norm_eps(model), "dropout_rate": model.dropout, "is_encoder_decoder": True,
        "tie_word_embeddings": True, "scale_decoder_outputs": True, "n_positions": model.max_seq_len, "pad_token_id": 0,
        "eos_token_id": 1, "decoder_start_token_id": 0,
    }


def _attention(hf: str, ours: str, model: ModelConfig) -> list[Rule]:
    return [scaled(f"{hf}.q.weight", f"{ours}.wq.weight", math.sqrt(model.head_dim)),
            *(same(f"{hf}.{name}.weight", f"{ours}.w{name}.weight") for name in ("k", "v", "o"))]


def _stack(hf: str, ours: str, layers: int, model: ModelConfig, cross: bool) -> list[Rule]:
    out = [same(f"{hf}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"{ours}.position.weight"),
           same(f"{hf}.final_layer_norm.weight", f"{ours}.final_norm.weight")]
    for i in range(layers):
        block, layer = f"{hf}.block.{i}.layer.", f"{ours}.layers.{i}."
        parts = [("SelfAttention", "attention")] + ([("EncDecAttention", "cross_attention")] if cross else [])
        for index, (hf_name, name) in enumerate(parts):
            out += _attention(f"{block}{index}.{hf_name}", f"{layer}{name}.sublayer", model)
            out.append(same(f"{block}{index}.layer_norm.weight", f"{layer}{name}.norm.weight"))
        ffn = len(parts)
        out += [same(f"{block}{ffn}.DenseReluDense.wi.weight", f"{layer}feed_forward.sublayer.w_in.weight"),
                same(f"{block}{ffn}.DenseReluDense.wo.weight", f"{layer}feed_forward.sublayer.w_out.weight"),
                same(f"{block}{ffn}.layer_norm.weight", f"{layer}feed_forward.norm.weight")]
    return out


def rules(model: ModelConfig) -> list[Rule]:
    out = [scaled("shared.weight", "embedding.weight", 1 / math.sqrt(model.d_model))]
    return (out + _stack("encoder", "stack", model.n_layers, model, cross=False)
            + _stack("decoder", "decoder", model.decoder_layers, model, cross=True))


T5 = Family(
    model_type="t5", architecture="T5ForConditionalGeneration", auto_class="AutoModelForSeq2SeqLM", base_prefix="",
    requires={"family": ("encoder_decoder",), "position.kind": ("t5_bias",), "norm.kind": ("rmsnorm",),
              "norm_placement": ("pre",), "embedding_norm": (False,), "ffn.kind": ("relu",), "bias": (False,),
              "lm_head_transform": (False,), "lm_head_bias": (False,), "n_kv_heads": (None,),
              "tie_embeddings": (True,)},
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
)
