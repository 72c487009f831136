"""``checkpoint.init_from=hf:DIR``: the trainer starts from the HF weights, so its first loss is HF's loss on the
same batch; one process here, a 2-rank layout in the slow tier; a converted checkpoint resumes the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.train.trainer import Trainer

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")
from hf_models import save  # noqa: E402

RUN = ["train.global_batch_size=4", "train.seq_len=16", "train.steps=2", "train.warmup_steps=0", "train.lr=1e-3",
       "train.log_every=100", "train.tensorboard=false", "train.plot=false", "train.progress=false",
       "train.peak_flops=1e12", "train.eval_every=0", "data.dataset=copy", "data.num_samples=32",
       "data.eval_fraction=0.0"]


def hf_loss(hf, batch: dict[str, torch.Tensor]) -> float:
    """HF's mean token cross-entropy over the batch's labelled tokens (xscale's labels, as the trainer reads them)."""
    decoder = {"decoder_input_ids": batch["decoder_input_ids"]} if "decoder_input_ids" in batch else {}
    with torch.no_grad():
        logits = hf(batch["input_ids"], **decoder).logits
    return float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100))


def _first_loss_and_hf_loss(config, hf) -> tuple[float, float]:
    trainer = Trainer(config)
    expected = hf_loss(hf, trainer.next_batch())  # step 0's batch, read before the run advances
    return trainer.fit()["losses"][0], expected


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_first_loss_equals_huggingface_loss(tmp_path, kind):
    hf = save(kind, tmp_path / "hf")
    config = load_config(None, [*RUN, f"checkpoint.init_from=hf:{tmp_path / 'hf'}", f"train.output_dir={tmp_path}"])
    assert config.model.vocab_size == hf.config.vocab_size  # the model section came from config.json
    first, expected = _first_loss_and_hf_loss(config, hf)
    assert abs(first - expected) <= 1e-5 * expected


def test_converted_checkpoint_resumes_as_init_from_does(tmp_path):
    from xscale.commands.convert import main as convert

    hf = save("llama", tmp_path / "hf")
    assert convert(["hf-to-xscale", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    config = load_config(None, [*RUN, f"checkpoint.init_from=hf:{tmp_path / 'hf'}",  # only for the model section
                                f"checkpoint.resume={tmp_path / 'ckpt' / 'step_00000000'}",
                                f"train.output_dir={tmp_path / 'run'}"])
    first, expected = _first_loss_and_hf_loss(config, hf)
    assert abs(first - expected) <= 1e-5 * expected


def test_model_overrides_still_apply_and_bad_sources_are_refused(tmp_path):
    save("gpt2", tmp_path / "hf")
    config = load_config(None, [f"checkpoint.init_from=hf:{tmp_path / 'hf'}", "model.dropout=0.2", "train.seq_len=16"])
    assert (config.model.dropout, config.model.position.kind) == (0.2, "learned")
    with pytest.raises(ConfigError, match="checkpoint.init_from"):
        load_config(None, ["checkpoint.init_from=gpt2"])
    with pytest.raises(ConfigError, match="checkpoint.init_from=hf:.*config.json is missing"):
        load_config(None, [f"checkpoint.init_from=hf:{tmp_path / 'nowhere'}"])


def _first_loss(config) -> float:
    return Trainer(config).fit()["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp=2", "dp_shard=2", "pp=2"])
def test_first_loss_equals_huggingface_loss_on_two_ranks(tmp_path, layout):
    from xscale.commands.parity import PARITY_SETTINGS, layout_overrides, run_local
    from xscale.data import GlobalSampler, build_datasets, collate

    hf = save("llama", tmp_path / "hf")
    zero_stage = 3 if layout.startswith("dp_shard") else 0  # ZeRO-3: every parameter a DTensor shard
    config = load_config(None, [*RUN, *PARITY_SETTINGS, *layout_overrides(layout), f"parallel.zero_stage={zero_stage}",
                                f"checkpoint.init_from=hf:{tmp_path / 'hf'}", f"train.output_dir={tmp_path / 'run'}"])
    first_losses = run_local(_first_loss, 2, config)
    dataset = build_datasets(config)[0]
    indices = GlobalSampler(len(dataset), config.train.global_batch_size, seed=config.train.seed).batch_indices(0)
    expected = hf_loss(hf, collate([dataset[i] for i in indices]))
    for first in first_losses:
        assert abs(first - expected) <= 1e-5 * expected, (layout, first, expected)
