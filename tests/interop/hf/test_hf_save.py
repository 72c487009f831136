"""Export: an xscale checkpoint written as an HF folder loads with ``from_pretrained`` and gives the same logits;
xscale -> HF -> xscale is the identity; shards get an index; a variant HF cannot express is refused."""

import json

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from xscale.interop.checkpoint import write_weights_checkpoint
from xscale.interop.hf.families import exportable_family
from xscale.interop.hf.load import fill_from_hf, hf_model_config, load_hf
from xscale.interop.hf.rules import InteropError
from xscale.interop.hf.save import export_hf
from xscale.models import build_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")
from hf_models import hf_logits, save, tokens  # noqa: E402

AUTO = {"gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM",
        "t5": "AutoModelForSeq2SeqLM"}


def _checkpoint_from_hf(hf_dir, out):
    model = hf_model_config(hf_dir)
    return write_weights_checkpoint(model, lambda state: fill_from_hf(state, hf_dir, model), out, source="test")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_exported_folder_loads_in_transformers_with_the_same_logits(tmp_path, kind):
    hf = save(kind, tmp_path / "hf")
    step_dir = _checkpoint_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    export_hf(step_dir, tmp_path / "out")
    reloaded = getattr(transformers, AUTO[kind]).from_pretrained(tmp_path / "out").eval()
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, batch), hf_logits(hf, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_xscale_to_hf_to_xscale_is_the_identity(tmp_path, kind):
    save(kind, tmp_path / "hf")
    config = hf_model_config(tmp_path / "hf")
    ours = build_model(config, "cpu", seed=7)  # xscale's own initialisation, not HF's
    expected = {name: tensor.clone() for name, tensor in get_model_state_dict(ours).items()}
    tied = expected.pop("output.weight") if config.tie_embeddings else None
    with torch.no_grad():
        for name, tensor in expected.items():  # norms and biases off their 1/0 initialisation
            tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)

    if tied is not None:
        expected["output.weight"] = expected["embedding.weight"]

    def fill(state):
        for name, tensor in state.items():
            tensor.copy_(expected[name])

    step_dir = write_weights_checkpoint(config, fill, tmp_path / "ckpt", source="test")
    export_hf(step_dir, tmp_path / "out")
    back_config, back = load_hf(tmp_path / "out")
    assert back_config == config
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_shards_with_an_index_when_over_the_size(tmp_path):
    hf = save("llama", tmp_path / "hf")
    step_dir = _checkpoint_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    export_hf(step_dir, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == files
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, batch), hf_logits(hf, batch), atol=1e-5, rtol=1e-5)


def test_tokenizer_files_travel_with_the_weights(tmp_path):
    from tokenizers import Tokenizer, models, trainers

    save("gpt2", tmp_path / "hf")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.train_from_iterator(["alpha beta gamma"] * 10, trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    hf_tokenizer = tmp_path / "tokenizer.json"
    (tmp_path / "hf" / "tokenizer.json").write_text(hf_tokenizer.read_text())
    model = hf_model_config(tmp_path / "hf")
    step_dir = write_weights_checkpoint(model, lambda state: fill_from_hf(state, tmp_path / "hf", model),
                                        tmp_path / "ckpt", source="test", tokenizer_from=tmp_path / "hf")
    assert (step_dir / "tokenizer" / "tokenizer.json").read_text() == hf_tokenizer.read_text()
    export_hf(step_dir, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == hf_tokenizer.read_text()


@pytest.mark.parametrize("setting, value", [("position", "alibi"), ("norm_placement", "sandwich"),
                                            ("share_layers", True), ("stack", "reversible")])
def test_a_variant_without_hf_equivalent_is_refused_naming_it(tmp_path, setting, value):
    save("llama", tmp_path / "hf")
    config = hf_model_config(tmp_path / "hf", {setting: value})
    with pytest.raises(InteropError, match=f"model.{setting}={value!r}"):
        exportable_family(config)


def test_attention_and_experts_are_refused_too(tmp_path):
    save("gpt2", tmp_path / "hf")
    assert exportable_family(hf_model_config(tmp_path / "hf", {"n_kv_heads": 4})).model_type == "gpt2"  # = n_heads
    with pytest.raises(InteropError, match="model.n_kv_heads=2"):
        exportable_family(hf_model_config(tmp_path / "hf", {"n_kv_heads": 2}))
    with pytest.raises(InteropError, match="model.attention.kind='local'"):
        exportable_family(hf_model_config(tmp_path / "hf", {"attention": {"kind": "local"}}))
    with pytest.raises(InteropError, match="model.moe.num_experts=4"):
        exportable_family(hf_model_config(tmp_path / "hf", {"moe": {"num_experts": 4}}))


def test_tied_llama_stores_its_head_once_and_reloads(tmp_path):
    from safetensors import safe_open

    hf = save("llama", tmp_path / "hf", tie_word_embeddings=True)
    assert hf_model_config(tmp_path / "hf").tie_embeddings
    export_hf(_checkpoint_from_hf(tmp_path / "hf", tmp_path / "ckpt"), tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(reloaded, batch), hf_logits(hf, batch), atol=1e-5, rtol=1e-5)


def test_a_trained_checkpoint_exports_as_llama(tmp_path):
    from xscale.config.load import load_config
    from xscale.train.trainer import Trainer

    config = load_config(None, ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                                "model.n_kv_heads=2", "model.tie_embeddings=false", "train.global_batch_size=4",
                                "train.seq_len=16", "train.steps=2", "train.tensorboard=false", "train.plot=false",
                                "train.progress=false", "train.peak_flops=1e12", "data.dataset=copy",
                                "data.num_samples=32", "data.eval_fraction=0.0", f"train.output_dir={tmp_path}"])
    trainer = Trainer(config)
    trainer.fit()
    export_hf(tmp_path / "checkpoints" / "step_00000002", tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batch = tokens() % 48
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, trainer.model.model.eval()(batch), atol=1e-5, rtol=1e-5)
