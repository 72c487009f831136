"""Context parallelism for the position-sparse attention cores (``cp_positions``): each cp rank computes only the
query blocks of its global positions against the all-gathered K/V.

Module level (2 gloo ranks): for every pattern kind, causal and bidirectional, contiguous and load balanced, with
attention dropout, each rank's hidden states, the summed loss and every gradient (summed over the cp ranks) equal
the single-process model's; one case with blocks that straddle two ranks' tokens. Trainer level: 10-step loss and
gradient-norm parity.
"""

from __future__ import annotations

import pytest
import torch
from parity_models import DECODER, ENCODER, assert_cores_under_cp_equal_one_process, assert_parity
from spawned import spawn

from xscale.models.registry import ATTENTION

SEQ, BATCH, SEED = 32, 2, 5
SMALL = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.max_seq_len=32", "train.seq_len=32", "model.dropout=0.1", "model.attention_dropout=0.2",
         "model.attention.options.block_size=4"]
OPTIONS = {
    "local": ["window=6"],
    "block_local": ["chunk=4"],
    "dilated": ["window=4", "dilation=2"],
    "strided": ["stride=4"],
    "fixed": ["stride=8", "summary=2"],
    "global": ["global_tokens=3", "window=4"],
    "random": ["random_blocks=2", "window=4"],
    "longformer": ["window=6", "global_tokens=3"],
    "bigbird": ["window=6", "global_tokens=3", "random_blocks=1"],
    "star": [],
    "axial": ["row=8"],
}
STRADDLING = ("bigbird", ["window=6", "global_tokens=3", "random_blocks=1", "block_size=6"])  # 6 does not divide 8


def _cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for kind, options in [*OPTIONS.items(), STRADDLING]:
        families = ("decoder", "encoder") if ATTENTION.get(kind).causal_capable else ("encoder",)
        cases += [(kind, family, options) for family in families]
    return cases


def _check_cases(rank: int) -> None:
    assert_cores_under_cp_equal_one_process(rank, _cases(), SMALL, seq=SEQ, batch_size=BATCH, seed=SEED)


def test_position_sparse_cores_under_context_parallelism_equal_one_process():
    spawn(_check_cases)


def test_only_the_held_query_blocks_are_planned():
    """Context parallelism divides the sparse cores' work: the plan of a rank's query blocks lists about 1/cp of the
    layout's non-zero blocks, and its rows are exactly the held blocks of every head."""
    from tests.models.attention.conftest import make_core

    core = make_core("local", True, {"window": 6, "block_size": 4}, max_seq_len=SEQ, n_kv_heads=2)
    whole = core.plan(SEQ, True, 4, 2, torch.device("cpu"), torch.float32)
    halves = [core.plan(SEQ, True, 4, 2, torch.device("cpu"), torch.float32,
                        query_positions=torch.arange(first, first + SEQ // 2)) for first in (0, SEQ // 2)]
    assert sum(plan.nonzero_blocks for plan in halves) == whole.nonzero_blocks
    rows = torch.cat([group.rows for group in halves[1].groups]).sort().values
    expected = torch.tensor([head * 8 + block for head in range(4) for block in range(4, 8)])
    assert torch.equal(rows, expected)


# ------------------------------------------------------------------------------------------------ trainer level
BIGBIRD = ["model.attention.kind=bigbird", "model.attention.options.window=4", "model.attention.options.global_tokens=2",
           "model.attention.options.random_blocks=1", "model.attention.options.block_size=2"]


def test_loss_parity_bigbird_decoder_load_balanced(tmp_path):
    assert_parity(DECODER + BIGBIRD, ["cp=2,cp_load_balance=true,zero_stage=1"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_longformer_encoder_tensor_x_context_and_pipeline(tmp_path):
    """A Longformer-style encoder under tp=2 x cp=2 with sequence parallelism, and a local-attention decoder under
    pp=2 x cp=2 (1F1B, 4 processes each)."""
    longformer = ["model.attention.kind=longformer", "model.attention.options.window=4",
                  "model.attention.options.global_tokens=2", "model.attention.options.block_size=2"]
    assert_parity(ENCODER + longformer, ["tp=2,cp=2,sequence_parallel=true"], tmp_path / "encoder",
                  same_grad_norms=True)
    local = ["model.attention.kind=local", "model.attention.options.window=4", "model.attention.options.block_size=4"]
    assert_parity(DECODER + local, ["pp=2,cp=2,microbatches=4,cp_load_balance=true"], tmp_path / "decoder",
                  same_grad_norms=True)
