"""The zoo matrix: every registered component trained through the trainer under a demanding layout, 10 steps
within a relative loss difference of 1e-5 of the single process, with dropout 0.1 (so its masks are checked to be
layout-independent too).

- attention, one case per class (aliases build the same core): pp2 x tp2 + sequence parallelism + full activation
  checkpointing, 2 microbatches (the single process runs the same microbatches: routing attention moves its
  centroids per microbatch); adaptive span with a penalty large enough to show, Performer/RFA redrawing every 3
  steps;
- FFN, norm, position encoding and residual placement: dp2 x tp2 + ZeRO-3 (the newer ones two to a case);
- MoE router: dp4 x ep2 and pp2 x dp2 x ep2 (4 processes each; one routing group of 4 sequences per microbatch,
  as the single process routes them), with the MoE metrics checked too;
- stack variant (``model.stack``, and ``model.share_layers``): the layouts it takes (those it refuses are tested in
  tests/parallel/test_checks_stack_variants.py), with the per-step gradient norms too;
- memory option (``MEMORY_OPTIONS``): trained on streams (data.order=streams), each rank carrying the memory of its
  own rows, with the gradient norms too: the segment memory under dp_shard2 x tp2 x ZeRO-3 with xl (dense) and with
  RoPE over sparse and linear cores (local, linear), the compressed memory (which refuses tp) under dp_shard2 x ZeRO-3.

Slow (~10 min). The fast meta-test fails when a registered component has no case here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from parity_models import DECODER, ENCODER, assert_parity

from tests.parallel.test_expert_layouts import GSHARD, HASH, SWITCH, TRAINING, assert_layouts_match
from xscale.config.schema import CHOICES, ModelConfig
from xscale.data.objectives import OBJECTIVES
from xscale.models.registry import ATTENTION, FFN, NORM, POSITION, ROUTER, STACK
from xscale.models.segment_memory import MEMORY_OPTIONS, MEMORY_POSITIONS

DROPOUT = ["model.dropout=0.1", "model.attention_dropout=0.1"]
ATTENTION_LAYOUT = "pp=2,tp=2,sequence_parallel=true,activation_checkpointing=full,microbatches=2"
COMPONENT_LAYOUT = "dp_shard=2,tp=2,zero_stage=3"
ROUTER_LAYOUTS = ("dp_shard=4,ep=2", "pp=2,dp_shard=2,ep=2,microbatches=2")
# Small enough for 16 tokens; each core reads the options it has. span_loss and redraw_every are large enough
# that a penalty counted per microbatch or a redraw counted per forward would show in the losses.
ATTENTION_OPTIONS = {"block_size": 4, "window": 4, "chunk": 4, "features": 16, "global_tokens": 2, "random_blocks": 1,
                     "buckets": 4, "rounds": 2, "landmarks": 4, "projected_length": 8, "clusters": 2,
                     "inducing_points": 4, "packed_length": 4, "compression": 2, "max_span": 16, "ramp": 4, "segment": 4, "persistent_vectors": 4,
                     "rank": 4, "span_loss": 0.01, "redraw_every": 3, "topk": 4}


def _attention_kinds() -> list[str]:
    """One registered name per attention class."""
    kinds: dict[type, str] = {}
    for name in ATTENTION.names():
        kinds.setdefault(ATTENTION.get(name), name)
    return sorted(kinds.values())


def _inline(options: dict) -> str:
    return "{" + ", ".join(f"{key}: {value}" for key, value in options.items()) + "}"


# Newer kinds run several to a case, one per layer (the slow tier's budget), with the options they need; they count as
# covered like ATTENTION_CASES. predictive twice, so that its carried maps cross the pipeline's stages.
PER_LAYER_ATTENTION_CASES = {"predictive-etc-image_local-bpt": (
    ["predictive", "etc", "image_local", "predictive", "bpt"],
    {"grid_width": 4, "query_block": [2, 2], "memory_margin": [1, 1]})}
_PER_LAYER = {ATTENTION.get(kind) for kinds, _ in PER_LAYER_ATTENTION_CASES.values() for kind in kinds}
ATTENTION_CASES = [kind for kind in _attention_kinds() if ATTENTION.get(kind) not in _PER_LAYER]
COMPONENT_CASES = {"ffn": ["gelu", "gelu_tanh", "geglu", "reglu", "relu", "swiglu"],
                   "norm": ["layernorm", "rmsnorm", "scalenorm"],
                   "position": ["alibi", "learned", "learned_frequency", "none", "rope", "sinusoidal", "t5_bias"]}
# Components run in pairs, two to a case (one relative position with one residual placement), to keep the slow tier
# short; they count as covered like COMPONENT_CASES.
PAIRED_CASES = {"shaw-rezero": {"position": "shaw", "norm_placement": "rezero"},
                "xl-deepnorm": {"position": "xl", "norm_placement": "deepnorm", "norm": "layernorm"},
                "tupe": {"position": "tupe"}, "deberta": {"position": "deberta"},
                "music": {"position": "music"}}
# Residual placements checked under tensor parallelism elsewhere (pre: every case here runs it, the default).
PLACEMENTS_ELSEWHERE = {"pre": "the default of every case here",
                        "post": "test_tensor_parallel.py's BERT cases and parity_models.py's encoder",
                        "sandwich": "test_tensor_parallel.py's decoder-untied-sandwich-bias-sp"}
# Components that declare no tensor-parallel split (refused under tp by name, their tests in tests/models/): dp x
# ZeRO-3 only, with the options they need.
UNSPLIT_LAYOUT = "dp_shard=2,zero_stage=3"
UNSPLIT_CASES = {"ffn": {"product_key": ["model.ffn.options={sub_keys: 8, topk: 4, heads: 2, key_dim: 16}"]}}
ROUTER_CASES = {"switch": SWITCH, "gshard": GSHARD, "hash": HASH,
                "expert_choice": ["model.family=encoder", "model.moe.router=expert_choice"],
                # balanced by construction: drops nothing
                "base": ["model.moe.router=base", "model.moe.top_k=1", "model.moe.dropless=true"]}
# ALBERT sharing's layouts (pipeline, ZeRO-3, tp) are test_layouts.py's test_shared_layers_* cases.
STACK_CASES = {"share_layers": None,
               "reversible": (["model.stack=reversible"], "dp_replicate=2,tp=2,zero_stage=2,sequence_parallel=true"),
               "act": (["model.share_layers=true", "model.stack=act", "model.n_layers=3",
                        "model.stack.options.ponder_cost=0.05"],
                       "dp_shard=2,tp=2,zero_stage=3"),
               "funnel": (["model.family=encoder", "model.position=learned", "model.max_seq_len=16",
                           "model.stack=funnel", "model.stack.options.groups=[1,1]"], "dp_shard=2,zero_stage=3"),
               # Classification runs under data parallelism only (tp/pp/cp refused for train.task=classify).
               "early_exit": (["model.family=encoder", "model.position=learned", "model.max_seq_len=16",
                               "train.task=classify", "data.dataset=lra_retrieval", "model.vocab_size=272",
                               "model.pooling=mean",
                               "model.stack=early_exit"], "dp_shard=2,zero_stage=3"),
               "token_learner": (["model.family=encoder", "model.position=learned", "model.max_seq_len=16",
                                  "train.task=classify", "data.dataset=lra_retrieval", "model.vocab_size=272",
                                  "model.pooling=mean", "model.stack=token_learner", "model.stack.options.tokens=4"],
                                 "dp_shard=2,zero_stage=3"),
               "gbst": (["model.family=encoder", "model.position=learned", "model.max_seq_len=16", "train.task=classify",
                         "data.dataset=lra_retrieval", "model.vocab_size=272", "model.pooling=mean", "model.stack=gbst"],
                        "dp_shard=2,zero_stage=3"),
               # Decoders only; each forward runs every block once per token, so 8 tokens in one microbatch a rank.
               "feedback": (["model.position=learned", "model.max_seq_len=16", "model.stack=feedback",
                             "train.seq_len=8", "train.micro_batch_size=4"], "dp_shard=2,zero_stage=3"),
               "perceiver": (["model.family=encoder", "model.position=learned", "model.max_seq_len=16",
                              "train.task=classify", "data.dataset=lra_retrieval", "model.vocab_size=272",
                              "model.pooling=mean", "model.stack=perceiver", "model.stack.options.latents=4"],
                             "dp_shard=2,zero_stage=3"),
               "memformer": (["model.position=learned", "model.max_seq_len=16", "model.stack=memformer",
                              "model.stack.options={slots: 4, segment: 4}"], "dp_shard=2,zero_stage=3")}


@pytest.mark.parametrize("option,registry", [("attention", ATTENTION), ("ffn", FFN), ("norm", NORM),
                                             ("position", POSITION), ("router", ROUTER)])
def test_every_registered_component_has_a_matrix_case(option, registry):
    """A component registered without a case here would never be checked against the single process."""
    if option == "attention":
        covered = {ATTENTION.get(kind) for kind in ATTENTION_CASES} | _PER_LAYER
        missing = {name for name in registry.names() if registry.get(name) not in covered}
    else:
        covered = set(ROUTER_CASES) if option == "router" else set(COMPONENT_CASES[option])
        covered |= {case[option] for case in PAIRED_CASES.values() if option in case}
        covered |= set(UNSPLIT_CASES.get(option, {}))
        missing = set(registry.names()) - covered
    assert not missing, f"{option}s without a zoo-matrix case: {sorted(missing)}"


def test_every_stack_variant_has_a_matrix_case():
    """Every registered model.stack kind but plain (every other case runs it), and ALBERT's model.share_layers."""
    assert set(STACK_CASES) == set(STACK.names()) - {"plain"} | {"share_layers"}, \
        "stack variants without a zoo-matrix case"


@pytest.mark.slow
@pytest.mark.parametrize("variant", [name for name, case in STACK_CASES.items() if case is not None])
def test_stack_variant_under_the_layouts_it_takes(variant, tmp_path):
    overrides, layout = STACK_CASES[variant]
    assert_parity([*DECODER, *DROPOUT, "train.micro_batch_size=2", *overrides], [layout], tmp_path,
                  same_grad_norms=True)


STREAM_TEXT = "\n".join(f"Line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5} times."
                        for i in range(300))
RECURRENT = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.position=xl",
             "model.segment_memory=16", "data.order=streams", "data.dataset=text", "data.tokenizer_vocab_size=512",
             "data.eval_fraction=0.0", "train.global_batch_size=8", "train.seq_len=16", "train.warmup_steps=2",
             "train.lr=3e-3", "train.micro_batch_size=2"]
MEMORY_CASES = {
    "segment_memory-xl-dense": ({"segment_memory": 16}, [], "dp_shard=2,tp=2,zero_stage=3"),
    "segment_memory-rope-local-linear": (
        {"segment_memory": 16}, ["model.position=rope", "model.attention.per_layer=[local, linear]",
                                 "model.attention.options={window: 4, block_size: 4, chunk: 4}"],
        "dp_shard=2,tp=2,zero_stage=3"),
    "compressed_memory": ({"segment_memory": 8, "compressed_memory": 8},
                          ["model.compression_rate=2"], "dp_shard=2,zero_stage=3"),
}


def test_every_memory_option_has_a_matrix_case():
    """Each memory option has a case, every ``*_memory`` model field is a memory option, and the cases run both
    positions a memory takes."""
    covered = {option for settings, _, _ in MEMORY_CASES.values() for option in settings}
    assert covered == set(MEMORY_OPTIONS), "memory options without a zoo-matrix case"
    fields = {field.name for field in dataclasses.fields(ModelConfig) if field.name.endswith("_memory")}
    assert fields <= set(MEMORY_OPTIONS), f"model fields {sorted(fields - set(MEMORY_OPTIONS))} not in MEMORY_OPTIONS"
    positions = {"rope" if "model.position=rope" in overrides else "xl" for _, overrides, _ in MEMORY_CASES.values()}
    assert positions == set(MEMORY_POSITIONS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_memory_option_under_the_layouts_it_takes(case, tmp_path):
    settings, overrides, layout = MEMORY_CASES[case]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(STREAM_TEXT)
    options = [f"model.{option}={value}" for option, value in settings.items()]
    assert_parity([*RECURRENT, *DROPOUT, *options, *overrides, f"data.path={corpus}"], [layout], tmp_path / "runs",
                  same_grad_norms=True)


def test_every_norm_placement_has_a_matrix_case():
    """model.norm_placement is a choice, not a registry: each value is run here or named with where it is run."""
    covered = {case["norm_placement"] for case in PAIRED_CASES.values() if "norm_placement" in case}
    missing = set(CHOICES["model.norm_placement"]) - covered - set(PLACEMENTS_ELSEWHERE)
    assert not missing, f"norm placements without a zoo-matrix case: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ATTENTION_CASES)
def test_attention_under_pipeline_tensor_sequence_parallel_and_recomputation(kind, tmp_path):
    cls = ATTENTION.get(kind)
    base = DECODER if cls.causal_capable else ENCODER
    overrides = [*base, *DROPOUT, "model.n_kv_heads=4", "train.micro_batch_size=4", f"model.attention.kind={kind}",
                 f"model.attention.options={_inline(ATTENTION_OPTIONS)}"]
    assert_parity(overrides, [ATTENTION_LAYOUT], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PER_LAYER_ATTENTION_CASES))
def test_attention_kinds_per_layer_under_pipeline_tensor_sequence_parallel_and_recomputation(case, tmp_path):
    kinds, options = PER_LAYER_ATTENTION_CASES[case]
    base = DECODER if all(ATTENTION.get(kind).causal_capable for kind in kinds) else ENCODER
    overrides = [*base, *DROPOUT, "model.n_kv_heads=4", "train.micro_batch_size=4", f"model.n_layers={len(kinds)}",
                 f"model.attention.per_layer=[{', '.join(kinds)}]",
                 f"model.attention.options={_inline(ATTENTION_OPTIONS | options)}"]
    assert_parity(overrides, [ATTENTION_LAYOUT], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("option,name", [(option, name) for option, names in COMPONENT_CASES.items()
                                         for name in names])
def test_component_under_data_tensor_parallel_and_zero3(option, name, tmp_path):
    overrides = [*DECODER, *DROPOUT, "train.micro_batch_size=2", "model.max_seq_len=16", f"model.{option}={name}"]
    assert_parity(overrides, [COMPONENT_LAYOUT], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("option,name", [(option, name) for option, names in UNSPLIT_CASES.items() for name in names])
def test_unsplit_component_under_data_parallel_and_zero3(option, name, tmp_path):
    overrides = [*DECODER, *DROPOUT, "train.micro_batch_size=2", "model.max_seq_len=16", f"model.{option}={name}",
                 *UNSPLIT_CASES[option][name]]
    assert_parity(overrides, [UNSPLIT_LAYOUT], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PAIRED_CASES))
def test_paired_components_under_data_tensor_parallel_and_zero3(case, tmp_path):
    """The gradient norms too: a table every tp rank reads for its own heads needs its partial gradients summed,
    which the losses alone barely show (AdamW is nearly blind to the gradient's scale)."""
    settings = [f"model.{option}={name}" for option, name in PAIRED_CASES[case].items()]
    overrides = [*DECODER, *DROPOUT, "train.micro_batch_size=2", "model.max_seq_len=16", *settings]
    assert_parity(overrides, [COMPONENT_LAYOUT], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_relative_positions_and_rezero_under_zero_bubble_pipeline(tmp_path):
    """Shaw's tables, read by every block of the stack, are held by both stages of each rank (their gradients
    summed) and reach the split backward of zero bubble's input and weight halves."""
    settings = [f"model.{option}={name}" for option, name in PAIRED_CASES["shaw-rezero"].items()]
    overrides = [*DECODER, *DROPOUT, "model.n_layers=4", *settings]
    assert_parity(overrides, ["pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2"], tmp_path)


@pytest.mark.slow
def test_compiled_zero_bubble_pipeline_with_a_learned_bias_table(tmp_path):
    """train.compile under zero bubble: the split backward runs twice over one graph (AOTAutograd's buffer donation
    is turned off for it) and the T5 table's gradient tap stays a node (traced, it was folded away: loss off 1.6e-4)."""
    overrides = [*DECODER, "model.n_layers=4", "model.n_kv_heads=4", "model.position=t5_bias", "model.max_seq_len=16",
                 "train.compile=true"]
    assert_parity(overrides, ["pp=2,microbatches=4,pp_schedule=zero_bubble,pp_stages_per_rank=2"], tmp_path,
                  same_grad_norms=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ROUTER_LAYOUTS, ids=["dp4_ep2", "pp2_dp2_ep2"])
@pytest.mark.parametrize("router", list(ROUTER_CASES))
def test_router_under_expert_parallel(router, layout, tmp_path):
    """One routing group of 4 sequences per microbatch in both layouts: the single process routes 4 at a time."""
    assert_layouts_match([*TRAINING, *ROUTER_CASES[router], *DROPOUT], 4, [layout], tmp_path,
                         dropless="model.moe.dropless=true" in ROUTER_CASES[router])


# The model's inputs (a choice) and the objectives (xscale.data.objectives' registry): each value names the test that
# runs it under the layouts it takes (file, test function); the layouts it refuses are refused by name there too.
CHOICE_CASES = {
    "model.input": {"tokens": ("tests/parallel/test_zoo_matrix.py", "test_component_under_data_tensor_parallel"),
                    "patches": ("tests/train/test_vit.py", "test_data_parallel_zero3_vit_matches_one_process")},
    "train.objective": {
        "auto": ("tests/parallel/test_layouts.py", "test_decoder_tensor_sequence_and_pipeline_parallel"),
        "clm": ("tests/parallel/test_layouts.py", "test_decoder_tensor_sequence_and_pipeline_parallel"),
        "mlm": ("tests/parallel/test_layouts.py", "test_encoder_tensor_and_pipeline_parallel"),
        "span": ("tests/parallel/test_layouts.py", "test_encoder_decoder_pipeline_x_tensor_parallel"),
        "bart": ("tests/train/test_bart.py", "test_bart_under_pipeline_parallelism_matches_one_process"),
        # The objectives with an extra head (model.objective_head): sop and electra run ZeRO-3 over two ranks;
        # spanbert and nsp (sop's head and loss) the in-process check that their loss splits over rows, which is
        # what dp and ZeRO rely on; pp, tp and cp are refused there by name.
        **dict.fromkeys(("sop", "electra"),
                        ("tests/train/test_bert_objectives.py", "test_zero3_over_two_ranks_matches_one_process")),
        **dict.fromkeys(("spanbert", "nsp"), ("tests/train/test_bert_objectives.py", "test_the_loss_sum_splits_over_rows"))},
}


@pytest.mark.parametrize("key", list(CHOICE_CASES))
def test_every_input_and_objective_has_a_parity_case(key):
    values = OBJECTIVES.names() if key == "train.objective" else CHOICES[key]
    assert set(CHOICE_CASES[key]) == set(values), f"{key} values without a parity case"
    root = Path(__file__).resolve().parents[2]
    for value, (path, test) in CHOICE_CASES[key].items():
        assert f"def {test}" in (root / path).read_text(), f"{key}={value}: {path} has no {test}"
