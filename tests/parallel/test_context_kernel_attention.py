"""Context parallelism for the kernel (linearized) attention cores, linear, Performer, RFA, cosFormer, and for
Linformer (``cp_positions``).

Each cp rank's queries run against the all-gathered keys: bidirectional, the single-device formula on its own
queries (Linformer: E and F project the whole gathered length); causal, each run of its positions from the state of
the keys before it (:func:`xscale.models.attention.linear.kernel_attention_at`). Module level (2 gloo ranks), decoder and encoder,
contiguous and load balanced, with dropout: each rank's hidden states, the summed loss and every gradient equal
one process's. Trainer level: 10-step loss parity of a Performer decoder, cp=2 load balanced, ZeRO-1.
"""

from __future__ import annotations

from parity_models import DECODER, assert_cores_under_cp_equal_one_process, assert_parity
from spawned import spawn

SEQ, BATCH, SEED = 32, 2, 7
SMALL = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.max_seq_len=32", "train.seq_len=32", "model.dropout=0.1", "model.attention_dropout=0.2"]
CASES = [(kind, family, options) for kind, options in (("linear", ["chunk=4"]),
                                                       ("performer", ["features=16", "chunk=4"]),
                                                       ("rfa", ["features=8", "chunk=8"]),
                                                       ("cosformer", ["chunk=4"]))
         for family in ("decoder", "encoder")] + [("linformer", "encoder", ["projected_length=8"])]


def _check_cases(rank: int) -> None:
    assert_cores_under_cp_equal_one_process(rank, CASES, SMALL, seq=SEQ, batch_size=BATCH, seed=SEED)


def test_kernel_attention_cores_under_context_parallelism_equal_one_process():
    spawn(_check_cases)


def test_loss_parity_performer_decoder_cp_and_dp(tmp_path):
    performer = ["model.attention.kind=performer", "model.attention.options.features=16",
                 "model.attention.options.chunk=4"]
    assert_parity(DECODER + performer, ["cp=2,cp_load_balance=true,zero_stage=1"], tmp_path, same_grad_norms=True)
