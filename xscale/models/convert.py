"""Import Hugging Face GPT-2 and BERT weights into xscale's Transformer.

Used as external oracles (a model with copied weights must give the same logits) and to start
training from a pretrained checkpoint. Only the architecture mapping lives here; loading the HF
model is the caller's business (``GPT2LMHeadModel.from_pretrained`` on a machine with the files).
"""

from __future__ import annotations

import torch

from xscale.config import ModelConfig


def gpt2_config(hf_config) -> ModelConfig:
    """GPT-2: pre-LN, learned positions, GELU (tanh), biases, tied embeddings (Radford et al. 2019)."""
    return ModelConfig(
        family="decoder", vocab_size=hf_config.vocab_size, d_model=hf_config.n_embd, n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head, d_ff=hf_config.n_inner or 4 * hf_config.n_embd,
        max_seq_len=hf_config.n_positions, position="learned", norm="layernorm", norm_placement="pre",
        norm_eps=hf_config.layer_norm_epsilon, ffn="gelu_tanh", bias=True, tie_embeddings=True,
    )


def gpt2_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map ``GPT2LMHeadModel.state_dict()`` to ours (HF's Conv1D stores weights transposed)."""
    d = config.d_model
    out = {"embedding.weight": hf_state["transformer.wte.weight"],
           "stack.position.weight": hf_state["transformer.wpe.weight"],
           "stack.final_norm.weight": hf_state["transformer.ln_f.weight"],
           "stack.final_norm.bias": hf_state["transformer.ln_f.bias"]}
    for i in range(config.n_layers):
        hf, ours = f"transformer.h.{i}.", f"stack.layers.{i}."
        attention, ffn = ours + "attention.", ours + "feed_forward."
        qkv_weight = hf_state[hf + "attn.c_attn.weight"].t()
        qkv_bias = hf_state[hf + "attn.c_attn.bias"]
        for j, name in enumerate(("wq", "wk", "wv")):
            out[f"{attention}sublayer.{name}.weight"] = qkv_weight[j * d:(j + 1) * d]
            out[f"{attention}sublayer.{name}.bias"] = qkv_bias[j * d:(j + 1) * d]
        out[attention + "sublayer.wo.weight"] = hf_state[hf + "attn.c_proj.weight"].t()
        out[attention + "sublayer.wo.bias"] = hf_state[hf + "attn.c_proj.bias"]
        out[attention + "norm.weight"] = hf_state[hf + "ln_1.weight"]
        out[attention + "norm.bias"] = hf_state[hf + "ln_1.bias"]
        out[ffn + "sublayer.w_in.weight"] = hf_state[hf + "mlp.c_fc.weight"].t()
        out[ffn + "sublayer.w_in.bias"] = hf_state[hf + "mlp.c_fc.bias"]
        out[ffn + "sublayer.w_out.weight"] = hf_state[hf + "mlp.c_proj.weight"].t()
        out[ffn + "sublayer.w_out.bias"] = hf_state[hf + "mlp.c_proj.bias"]
        out[ffn + "norm.weight"] = hf_state[hf + "ln_2.weight"]
        out[ffn + "norm.bias"] = hf_state[hf + "ln_2.bias"]
    out["output.weight"] = out["embedding.weight"]
    return {name: value.detach().clone() for name, value in out.items()}


def bert_config(hf_config) -> ModelConfig:
    """BERT: post-LN, learned positions + embedding LayerNorm, GELU, MLM head transform (Devlin et al. 2019)."""
    return ModelConfig(
        family="encoder", vocab_size=hf_config.vocab_size, d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers, n_heads=hf_config.num_attention_heads,
        d_ff=hf_config.intermediate_size, max_seq_len=hf_config.max_position_embeddings, position="learned",
        norm="layernorm", norm_placement="post", norm_eps=hf_config.layer_norm_eps, embedding_norm=True,
        ffn="gelu", bias=True, tie_embeddings=True, lm_head_transform=True, lm_head_bias=True,
    )


def bert_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map ``BertForMaskedLM.state_dict()`` to ours. Segment (token type) 0's embedding is folded
    into the position table, which is exact for single-segment inputs."""
    embeddings = "bert.embeddings."
    out = {
        "embedding.weight": hf_state[embeddings + "word_embeddings.weight"],
        "stack.position.weight": hf_state[embeddings + "position_embeddings.weight"]
        + hf_state[embeddings + "token_type_embeddings.weight"][0],
        "embedding_norm.weight": hf_state[embeddings + "LayerNorm.weight"],
        "embedding_norm.bias": hf_state[embeddings + "LayerNorm.bias"],
        "head_transform.dense.weight": hf_state["cls.predictions.transform.dense.weight"],
        "head_transform.dense.bias": hf_state["cls.predictions.transform.dense.bias"],
        "head_transform.norm.weight": hf_state["cls.predictions.transform.LayerNorm.weight"],
        "head_transform.norm.bias": hf_state["cls.predictions.transform.LayerNorm.bias"],
        "output.bias": hf_state["cls.predictions.bias"],
    }
    for i in range(config.n_layers):
        hf, ours = f"bert.encoder.layer.{i}.", f"stack.layers.{i}."
        for hf_name, name in (("query", "wq"), ("key", "wk"), ("value", "wv")):
            for kind in ("weight", "bias"):
                out[f"{ours}attention.sublayer.{name}.{kind}"] = hf_state[f"{hf}attention.self.{hf_name}.{kind}"]
        pairs = {
            "attention.sublayer.wo": "attention.output.dense", "attention.norm": "attention.output.LayerNorm",
            "feed_forward.sublayer.w_in": "intermediate.dense", "feed_forward.sublayer.w_out": "output.dense",
            "feed_forward.norm": "output.LayerNorm",
        }
        for name, hf_name in pairs.items():
            for kind in ("weight", "bias"):
                out[f"{ours}{name}.{kind}"] = hf_state[f"{hf}{hf_name}.{kind}"]
    out["output.weight"] = out["embedding.weight"]
    return {name: value.detach().clone() for name, value in out.items()}
