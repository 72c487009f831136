"""What each block kind refuses, by its declared traits, in one line naming the setting and the way out."""

from __future__ import annotations

import pytest

from xscale.config.check import validate
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError

TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.seq_len=16",
        "data.dataset=copy"]


def _validate(*overrides: str) -> None:
    validate(load_config_from_cli(None, [*TINY, *overrides]))


@pytest.mark.parametrize("overrides,message", [
    (["model.block={kind: lite, options: {conv_heads: 1}}", "parallel.tp=2"],
     r"lite under parallel.tp=2 gives each rank its channels .* make model.block.options.conv_heads=1 a multiple of 2"),
    (["model.block=lite", "model.n_heads=2", "parallel.tp=2"],
     r"lite under parallel.tp=2 splits the attention half's n_heads/2=1 heads .* multiples of 4"),
    (["model.block=lite", "parallel.cp=2"], r"model.block=lite does not take parallel.cp > 1: the convolution half"),
    (["model.block=evolved", "parallel.cp=2"], r"model.block=evolved does not take parallel.cp > 1: the cell's 3x1"),
    (["model.block=gtrxl", "model.stack=reversible"], r"model.block=gtrxl does not take model.stack other than plain"),
    (["model.block=sandwich", "parallel.activation_checkpointing=selective"],
     r"does not take parallel.activation_checkpointing=selective: .* use parallel.activation_checkpointing=full"),
    (["model.block=sandwich", "model.share_layers=true"], r"does not take model.share_layers=true"),
    (["model.block=sandwich", "model.family=encoder_decoder"], r"does not take model.family=encoder_decoder"),
    (["model.block={kind: sandwich, options: {pattern: sfsf}}", "model.n_layers=3"], r"must have 3 's' and 3 'f'"),
    (["model.block={kind: sandwich, options: {depth: 2}}"], r"depth"),
    (["model.block=macron"], r"model.block='macron' is not a known block.*macaron"),
    (["model.block=gtrxl", "model.norm_placement=post"], r"gtrxl reads norm\(x\) .* set model.norm_placement=pre"),
    (["model.block=lite", "model.position=alibi"], r"model.position=alibi keeps per-head .* use one of rope"),
    (["model.block={kind: lite, options: {conv_heads: 3}}"], r"16 channels do not split into conv_heads=3"),
    (["model.block=lite", "model.n_heads=1"], r"make model.n_heads=1, model.n_kv_heads and model.d_model=32 even"),
    (["model.block=lite", "parallel.activation_checkpointing=selective"], r"LSRA's sits one module deeper"),
    (["model.block=evolved", "model.norm_placement=post"], r"evolved is the paper's pre-norm cell"),
    (["model.block=evolved", "model.segment_memory=8", "model.position=xl", "data.order=streams"],
     r"does not take model.segment_memory > 0"),
    (["model.init=admin"], r"model.init=admin scales post-norm residuals .* set model.norm_placement=post"),
])
def test_refused_with_the_reason_and_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _validate(*overrides)


def test_taken_settings_pass() -> None:
    for kind in ("macaron", "{kind: sandwich, options: {pattern: ssff}}", "gtrxl", "lite", "evolved"):
        _validate(f"model.block={kind}", "parallel.tp=2", "parallel.sequence_parallel=true")
    _validate("model.block=macaron", "parallel.zero_stage=3")
    _validate("model.block={kind: sandwich, options: {pattern: ssff}}", "parallel.activation_checkpointing=full")
    _validate("model.norm_placement=post", "model.init=admin", "parallel.tp=2")
