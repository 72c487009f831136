"""Transformer-XL recurrence (model.segment_memory) under data parallelism, ZeRO and tensor parallelism: each
rank carries the memory of its own rows, and the losses and gradient norms match the single process."""

from __future__ import annotations

import pytest
from parity_models import DROPOUT, assert_parity

TEXT = "\n".join(f"Line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5} times." for i in range(300))
RECURRENT = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.position=xl",
             "model.segment_memory=16", "data.order=streams", "data.dataset=text", "data.tokenizer_vocab_size=512",
             "data.eval_fraction=0.0", "train.global_batch_size=8", "train.seq_len=16", "train.warmup_steps=2",
             "train.lr=3e-3"]


@pytest.mark.slow
def test_segment_memory_under_data_zero_and_tensor_parallel(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    assert_parity([*RECURRENT, *DROPOUT, f"data.path={corpus}"], ["dp_shard=2,tp=2,zero_stage=3"],
                  tmp_path / "runs", same_grad_norms=True)


@pytest.mark.slow
def test_compressed_memory_under_data_parallel_and_zero3(tmp_path):
    """The Compressive Transformer's f_c (a conv per layer, trained by the reconstruction loss) sharded by ZeRO-3."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    compressive = ["model.segment_memory=8", "model.compressed_memory=8", "model.compression_rate=2"]
    assert_parity([*RECURRENT, *DROPOUT, *compressive, f"data.path={corpus}"], ["dp_shard=2,zero_stage=3"],
                  tmp_path / "runs", same_grad_norms=True)
