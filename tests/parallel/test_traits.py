"""Components declare their parallel traits (xscale.models.traits) and the plans read only those: every registered
attention core and FFN declares traits that agree with what it computes, and the tensor- and context-parallel
checks accept or refuse a core by its traits alone (a new class needs no edit in xscale/parallel)."""

from __future__ import annotations

import pytest
from parity_models import DECODER, DROPOUT, assert_parity
from torch import nn

from tests.parallel.test_zoo_matrix import UNSPLIT_CASES
from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig
from xscale.models.attention import AttentionCore
from xscale.models.registry import ATTENTION, FFN
from xscale.models.traits import NO_TRAITS, ParallelTraits, traits_of
from xscale.parallel.context import check_context_parallel_model
from xscale.parallel.tensor import check_tensor_parallel

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
ATTENTION_SPLITS = ("split_heads", "head_state", "gather_heads")


@pytest.mark.parametrize("kind", ATTENTION.names())
def test_every_attention_core_declares_traits_that_match_what_it_computes(kind: str) -> None:
    core = ATTENTION.get(kind)
    traits = traits_of(core)
    assert traits is not NO_TRAITS, f"attention '{kind}' ({core.__name__}) declares no parallel_traits"
    assert traits.tp in ATTENTION_SPLITS or traits.tp == "none"
    assert core.mixes_heads == (traits.tp == "gather_heads"), "a core that mixes heads must gather them, and only it"
    assert bool(core.per_head_state) == (traits.tp == "head_state"), "per-head state is split by head under tp"
    assert not traits.cp or core.supports_bias, "context parallelism passes the causal mask as an additive bias"


@pytest.mark.parametrize("kind", FFN.names())
def test_every_ffn_declares_its_column_and_row_parallel_linears(kind: str) -> None:
    """Or declares no split, then runs without tp: the zoo matrix's UNSPLIT_CASES (tp refuses it by name)."""
    ffn = FFN.get(kind)(16, 32)
    traits = traits_of(ffn)
    assert traits.tp == "split_hidden" or (traits.tp == "none" and kind in UNSPLIT_CASES["ffn"])
    for name in traits.column_parallel + traits.row_parallel:
        assert isinstance(getattr(ffn, name), nn.Linear), f"{kind}: {name} is not a linear layer"


class _Core(AttentionCore):
    """A stand-in core: only its declarations matter to the checks."""


def _register(monkeypatch: pytest.MonkeyPatch, traits: ParallelTraits | None, **flags) -> str:
    attributes = dict(flags) if traits is None else dict(flags, parallel_traits=traits)
    monkeypatch.setitem(ATTENTION._entries, "new_core", type("NewCore", (_Core,), attributes))
    return "new_core"


def _model(kind: str, **options) -> ModelConfig:
    return ModelConfig(**SMALL, attention=AttentionConfig(kind=kind, options=options))


@pytest.mark.parametrize("flags,why", [
    ({}, r"declares no head split \(its parallel_traits.tp is 'none'\)"),
    ({"mixes_heads": True}, "mixes information across heads"),
    ({"per_head_state": ("widths",)}, r"keeps per-head state \(widths\)"),
    ({"carries_scores": True}, "passes attention scores between layers"),
])
def test_tensor_parallel_refuses_a_core_without_a_head_split(monkeypatch, flags: dict, why: str) -> None:
    kind = _register(monkeypatch, None, **flags)
    with pytest.raises(ConfigError, match=f"attention '{kind}' {why}, so the tensor-parallel plan refuses it; "
                                          r"use parallel.tp=1 .*dense/gqa/mha/mqa.*declare how its heads split"):
        check_tensor_parallel(_model(kind), 2)


def test_tensor_parallel_accepts_a_core_by_its_traits(monkeypatch) -> None:
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads", head_dependent_options=("split_heads",)))
    check_tensor_parallel(_model(kind), 2)
    with pytest.raises(ConfigError, match=f"attention '{kind}' with model.attention.options.split_heads=true"):
        check_tensor_parallel(_model(kind, split_heads=True), 2)


def test_a_head_mixing_core_must_declare_that_it_gathers_heads(monkeypatch) -> None:
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads"), mixes_heads=True)
    with pytest.raises(ConfigError, match=f"attention '{kind}' mixes information across heads"):
        check_tensor_parallel(_model(kind), 2)


def test_context_parallelism_serves_the_cores_that_declare_it(monkeypatch) -> None:
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads"), supports_bias=True)
    with pytest.raises(ConfigError, match=f"attention '{kind}' is not sharded by context parallelism.*only .*"
                                          r"axial, .*dense, .*mqa, .*strided, .* all-gather over the cp ranks "
                                          r".*parallel_traits declare cp, cp_positions or cp_whole_sequence"):
        check_context_parallel_model(_model(kind), 2)
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads", cp=True), supports_bias=True)
    check_context_parallel_model(_model(kind), 2)
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads", cp_positions=True))
    check_context_parallel_model(_model(kind), 2)
    kind = _register(monkeypatch, ParallelTraits(tp="split_heads", cp_whole_sequence=True))
    check_context_parallel_model(_model(kind), 2)


def test_tensor_parallel_refuses_an_ffn_without_declared_linears(monkeypatch) -> None:
    monkeypatch.setitem(FFN._entries, "new_ffn", type("NewFFN", (nn.Module,), {}))
    with pytest.raises(ConfigError, match="model.ffn=new_ffn declares no column/row-parallel split"):
        check_tensor_parallel(ModelConfig(**SMALL, ffn="new_ffn"), 2)


def test_split_hidden_names_its_linears() -> None:
    with pytest.raises(ValueError, match="split_hidden"):
        ParallelTraits(tp="split_hidden", column_parallel=("w_in",))


@pytest.mark.slow
def test_a_core_added_in_its_own_file_trains_under_data_and_pipeline_parallelism(tmp_path) -> None:
    """cosFormer (its own file and one registration line) matches one process at dp=2 and pp=2 by its traits alone
    (pp=2 x tp=2 with sequence parallelism and recomputation: tests/parallel/test_zoo_matrix.py)."""
    overrides = [*DECODER, *DROPOUT, "model.attention.kind=cosformer", "model.attention.options={chunk: 4}"]
    assert_parity(overrides, ["dp_shard=2", "pp=2,microbatches=4"], tmp_path)
