"""Config loading, overrides and the table of refusals: each bad input gets a message saying what to change."""

import pytest

from xscale.config.load import load_config, load_config_from_cli, parse_override
from xscale.config.schema import Config, ConfigError

BAD_INPUTS = [
    (["model.n_head=8"], "did you mean 'n_heads'"),
    (["trian.steps=5"], "did you mean 'train'"),
    (["model.n_heads=5"], "does not divide model.d_model"),
    (["model.n_kv_heads=3"], "must divide model.n_heads"),
    (["model.n_kv_heads=0"], "must divide model.n_heads"),
    (["model.ffn=swigl"], "did you mean 'swiglu'"),
    (["model.norm=batchnorm"], "not a known norm"),
    (["model.position=rotary"], "not a known position"),
    (["model.attention.kind=flash"], "not a known attention"),
    (["model.family=gpt"], "not one of decoder, encoder, encoder_decoder"),
    (["model.norm_placement=middle"], "not one of pre, post, sandwich"),
    (["train.steps=abc"], "expected an integer"),
    (["train.steps=0"], "train.steps must be positive"),
    (["train.lr=-1"], "train.lr must be positive"),
    (["train.precision=fp16"], "not one of fp32, bf16, fp8"),
    (["train.fp8_recipe=delayed"], "not one of tensorwise, rowwise"),
    (["train.warmup_steps=-5"], "warmup_steps must be >= 0"),
    (["train.global_batch_size=0"], "global_batch_size must be positive"),
    (["model.dropout=1.5"], "model.dropout must be in [0, 1)"),
    (["model.position=learned", "train.seq_len=512", "model.max_seq_len=256"], "exceeds model.max_seq_len"),
    (["train.objective=mlm"], "needs model.family=encoder"),
    (["model.family=encoder", "model.position=none"], "only works for decoders"),
    (["model.d_model=30", "model.n_heads=10"], "even head dimension"),
    (["model.tie_embeddings=yes please"], "expected true/false"),
    (["checkpoint.keep=0"], "checkpoint.keep must be at least 1"),
    (["train.steps"], "must look like section.key=value"),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "top_k=5 must be in [1, num_experts=4]"),
    (["train.lr=.inf"], "train.lr=inf is not a finite number"),
    (["train.lr=nan"], "train.lr=nan is not a finite number"),
    (["train.grad_clip=nan"], "train.grad_clip=nan is not a finite number"),
    (["model.norm.options.eps=-1"], "model.norm.options.eps must be positive"),
    (["model.init_std=-1"], "model.init_std must be positive"),
    (["model.d_ff=-5"], "model.d_ff must be positive"),
    (["train.beta1=1.5"], "train.beta1 must be in [0, 1)"),
    (["train.eps=-1"], "train.eps must be positive"),
    (["train.weight_decay=-1"], "train.weight_decay must be >= 0"),
    (["train.min_lr_ratio=-2"], "train.min_lr_ratio must be in [0, 1]"),
    (["checkpoint.every=-2"], "checkpoint.every must be >= -1 (0: only at the end; -1: none"),
    (["checkpoint.memory_every=-2"], "checkpoint.memory_every must be >= 0 (0: no memory snapshots)"),
    (["train.output_dir="], "train.output_dir is empty"),
    (["train.lr=!!python/object/apply:os.system [echo]"], "the value is not plain YAML"),
    (["model.family=encoder_decoder", "parallel.tp=2", "train.compile=true"],
     "train.compile=true with an encoder-decoder (torch's compiler"),
    (["model.position=xl", "model.segment_memory=8", "data.dataset=stdlib_text", "data.order=streams",
      "parallel.tp=2", "train.compile=true"], "train.compile=true with model.segment_memory (torch's compiler"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_refused_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_default_config_is_valid():
    config = load_config()
    assert isinstance(config, Config)
    assert config.model.family == "decoder"


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 4\ntrain:\n  steps: 7\n  warmup_steps: 2\n")
    config = load_config(path, ["train.lr=3e-4", "model.attention.options.window=16", "model.n_kv_heads=2"])
    assert config.model.d_model == 64 and config.train.steps == 7
    assert config.train.lr == pytest.approx(3e-4) and isinstance(config.train.lr, float)
    assert config.model.attention.options == {"window": 16}
    assert config.model.kv_heads == 2


def test_cli_form_accepts_overrides_without_a_config():
    config = load_config_from_cli("train.steps=3", ["model.n_layers=1"])
    assert config.train.steps == 3 and config.model.n_layers == 1


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError):
        load_config(path)


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=true") == (["a"], True)


def test_context_parallel_span_corruption_lengths_must_split():
    """Span corruption of text windows gives an encoder-decoder shorter inputs and targets than train.seq_len; under
    cp both must split into the chunks, and the message names seq_len values whose three lengths do."""
    base = ["model.family=encoder_decoder", "data.dataset=stdlib_text", "parallel.cp=2", "model.max_seq_len=128"]
    with pytest.raises(ConfigError, match=r"4 chunks.*train.seq_len=128 windows gives 116 encoder and 26 decoder "
                                          r"tokens: use train.seq_len=96 or 92 or 56"):
        load_config(None, [*base, "parallel.cp_load_balance=true", "train.seq_len=128"])
    from xscale.data.objectives import span_corruption_lengths

    assert [length % 4 for length in (96, *span_corruption_lengths(96))] == [0, 0, 0]
    load_config(None, [*base, "parallel.cp_load_balance=true", "train.seq_len=96"])
    load_config(None, [*base, "data.dataset=copy", "train.seq_len=16"])  # task lengths are checked when cut
