"""The two reference models of the layout parity tests and the check they share."""

from __future__ import annotations

from xscale.parity import compare_layouts

# Llama-style decoder (RoPE + SwiGLU + RMSNorm + GQA) and BERT-style encoder (MLM), small enough for 2 CPU cores.
DECODER = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.position=rope", "model.ffn=swiglu", "model.norm=rmsnorm",
           "train.global_batch_size=8", "train.seq_len=16", "train.warmup_steps=2", "train.lr=3e-3",
           "data.dataset=copy", "data.num_samples=256", "data.eval_fraction=0.0"]
ENCODER = ["model.family=encoder", "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
           "model.position=learned", "model.max_seq_len=16", "model.norm=layernorm", "model.norm_placement=post",
           "model.ffn=gelu", "model.bias=true", "model.embedding_norm=true", "model.lm_head_transform=true",
           "model.lm_head_bias=true", "train.global_batch_size=8", "train.seq_len=16", "train.warmup_steps=2",
           "train.lr=3e-3", "data.dataset=copy", "data.num_samples=256", "data.eval_fraction=0.0"]
# Residual, FFN, embedding and attention-probability dropout, in microbatches of 2 (masks must follow samples).
DROPOUT = ["model.dropout=0.1", "model.attention_dropout=0.1", "train.micro_batch_size=2"]
RTOL = 1e-5
STEPS = 10


def assert_parity(overrides: list[str], layouts: list[str], tmp_path) -> None:
    """Every layout's 10 per-step losses within RTOL of the single-process run's (which must train)."""
    reference, results = compare_layouts(None, overrides, layouts, STEPS, tmp_path)
    assert len(reference) == STEPS and reference[-1] < reference[0], "the reference run must train"
    for result in results:
        assert len(result.losses) == STEPS, result.layout
        assert result.passed(RTOL), f"{result.layout}: max relative loss difference {result.max_relative_difference}"
