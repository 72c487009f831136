"""ViT on the procedural shapes task end to end (model.input=patches, data.dataset=images_shapes): a tiny model learns
it well above the majority class, the layouts it cannot take are refused by name, and data parallelism with ZeRO
(slow) matches one process."""

import json

import pytest

from xscale.cli import main
from xscale.commands.parity import compare_layouts
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError

VIT = ["model.family=encoder", "train.task=classify", "data.dataset=images_shapes", "model.input=patches",
       "model.image_size=16", "model.patch_size=4", "train.seq_len=17", "model.max_seq_len=17",
       "model.position=learned", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.pooling=cls"]
RUN = ["train.global_batch_size=32", "train.warmup_steps=5", "train.lr=3e-3", "train.weight_decay=0.0",
       "train.loggers=[jsonl]", "train.plot=false", "train.progress=false", "train.watchdog=false",
       "train.peak_flops=1e12"]


def test_a_tiny_vit_learns_the_shapes_well_above_the_majority_class(tmp_path, one_thread):
    assert main(["train", *VIT, *RUN, "data.num_samples=3840", "data.eval_fraction=0.0334", "train.steps=120",
                 "train.eval_every=120", "train.eval_batches=4", f"train.output_dir={tmp_path}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [record["eval/accuracy"] for record in records if "eval/accuracy" in record]
    assert accuracy and accuracy[-1] >= 0.45, accuracy  # four balanced classes: the majority is about 0.3 of 128


@pytest.mark.parametrize("layout", ["tp=2", "pp=2", "cp=2"])
def test_model_parallel_layouts_are_refused_by_name(layout):
    name = layout.split("=")[0]
    with pytest.raises(ConfigError, match=f"parallel.{name}=2 is not supported"):
        load_config_from_cli(None, [*VIT, f"parallel.{layout}"])


@pytest.mark.parametrize("overrides,message", [
    (["train.seq_len=16"], "train.seq_len=16 must be the patch count plus the class token.*train.seq_len=17"),
    (["model.patch_size=3"], "model.patch_size=3 does not divide model.image_size=16"),
    (["model.input=tokens"], "data.dataset=images_shapes .* and model.input=patches go together"),
    (["model.moe.num_experts=2", "model.moe.router=hash"], "model.moe.router=hash routes by token id"),
])
def test_inconsistent_image_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*VIT, *overrides])


@pytest.mark.slow
def test_data_parallel_zero3_vit_matches_one_process(tmp_path):
    """Two data-parallel ranks with ZeRO-3 and gradient accumulation give the one-process losses."""
    overrides = [*VIT, *RUN, "train.micro_batch_size=4", "train.global_batch_size=16", "data.num_samples=256",
                 "data.eval_fraction=0.0", "train.warmup_steps=0"]
    reference, results = compare_layouts(None, overrides, ["dp_shard=2,zero_stage=3"], 5, tmp_path)
    assert reference[-1] < reference[0], f"the reference run must train: {reference}"
    assert len(results[0].losses) == 5 and results[0].passed(1e-5), (reference, results[0])
