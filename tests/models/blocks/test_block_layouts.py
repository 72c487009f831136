"""The block kinds and Admin under the layouts they take, at one-process parity (10 steps, dropout 0.1, gradient
norms too): each kind under dp_shard=2 x ZeRO-3 (FSDP2 gathers each block's parameters, whatever it holds), with
recomputation on for the kinds that take it, DeLighT under pp2 x cp2 too; Admin's omega under tp=2 with sequence
parallelism (the plan replicates a residual's gain on the stream). The kinds refuse tp by name
(test_block_checks.py)."""

from __future__ import annotations

import pytest
from parity_models import DECODER, DROPOUT, assert_parity

from xscale.models.registry import BLOCK

DELIGHT = ["model.position=learned", "model.block={kind: delight, options: {min_depth: 2, max_depth: 4, max_groups: 4}}"]
CASES = {
    "macaron-admin": (["model.block=macaron", "model.norm=layernorm", "model.norm_placement=post",
                       "model.init=admin"], "dp_shard=2,zero_stage=3"),
    "sandwich": (["model.block={kind: sandwich, options: {pattern: ssff}}"],
                 "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "gtrxl": (["model.block=gtrxl"], "dp_shard=2,zero_stage=3"),
    "evolved": (["model.block=evolved"], "dp_shard=2,zero_stage=3,activation_checkpointing=selective"),
    "lite": (["model.block={kind: lite, options: {kernel_size: 3, conv_heads: 2}}"],
             "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "delight": (DELIGHT, "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "delight-pp-cp": (DELIGHT, "pp=2,cp=2,microbatches=4"),
    "admin-tp": (["model.norm=layernorm", "model.norm_placement=post", "model.init=admin"],
                 "tp=2,sequence_parallel=true"),
}


def test_every_block_kind_has_a_layout_case() -> None:
    """A kind registered without a case here would never be checked against the single process (standard: every
    other parity test runs it)."""
    covered = {override.split("=", 1)[1].removeprefix("{kind: ").split(",")[0].rstrip("}")
               for overrides, _ in CASES.values() for override in overrides if override.startswith("model.block=")}
    assert covered == set(BLOCK.names()) - {"standard"}, "block kinds without a layout case"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_block_kind_under_the_layouts_it_takes(case, tmp_path) -> None:
    overrides, layout = CASES[case]
    assert_parity([*DECODER, *DROPOUT, "model.max_seq_len=16", *overrides], [layout], tmp_path, same_grad_norms=True)
