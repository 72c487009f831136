"""``xscale export``'s default file loads back: tied weights stored once and restored, ``strict=True`` holds, and
``xscale convert safetensors-to-xscale`` makes a checkpoint of it again."""

import torch

from xscale.commands.convert import main as convert
from xscale.commands.export import export_safetensors
from xscale.config.load import load_config
from xscale.interop import load_exported
from xscale.train.trainer import Trainer

TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "train.global_batch_size=4", "train.seq_len=16", "train.steps=2", "train.log_every=100",
        "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.peak_flops=1e12",
        "data.dataset=copy", "data.num_samples=32", "data.eval_fraction=0.0"]


def _trained(tmp_path, *extra):
    trainer = Trainer(load_config(None, [*TINY, f"train.output_dir={tmp_path}", *extra]))
    trainer.fit()
    return trainer, {name: value.clone() for name, value in trainer.model.model.state_dict().items()}


def test_export_loads_back_strictly_with_the_tie_restored(tmp_path):
    trainer, expected = _trained(tmp_path)
    path = export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
    model = load_exported(path)  # build_model + load_state_dict(strict=True)
    assert model.output.weight is model.embedding.weight
    assert model.config == trainer.config.model
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_untied_export_keeps_its_head(tmp_path):
    _, expected = _trained(tmp_path, "model.tie_embeddings=false")
    model = load_exported(export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors"))
    assert model.output.weight is not model.embedding.weight
    assert torch.equal(model.output.weight, expected["output.weight"])


def test_export_converts_back_to_a_checkpoint_that_exports_the_same(tmp_path):
    _trained(tmp_path)
    first = export_safetensors(tmp_path / "checkpoints", tmp_path / "first.safetensors")
    assert convert(["safetensors-to-xscale", str(first), str(tmp_path / "again")]) == 0
    second = export_safetensors(tmp_path / "again", tmp_path / "second.safetensors")
    one, two = load_exported(first).state_dict(), load_exported(second).state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)
