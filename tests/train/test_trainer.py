"""The trainer end to end on one process: bit-identical resume, atomic checkpoints, clear errors, export."""

import json
import shutil

import pytest
import torch

from xscale.checkpoint.checkpointer import Checkpointer, CheckpointError
from xscale.config.load import load_config
from xscale.train.trainer import Trainer

TINY = [
    "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.dropout=0.1",  # dropout masks must follow the step (xscale/models/dropout.py) for a resume to be exact
    "train.global_batch_size=4", "train.seq_len=16", "train.warmup_steps=3", "train.log_every=100",
    "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.peak_flops=1e12",
    "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0",
]


def _config(tmp_path, *extra):
    return load_config(None, [*TINY, f"train.output_dir={tmp_path}", *extra])


def _parameters(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.model.named_parameters()}


@pytest.mark.parametrize("forget_rng", [False, True], ids=["rng-restored", "rng-lost"])
def test_resume_is_bit_identical(tmp_path, forget_rng):
    """20 steps == 10 + resume + 10, bit for bit; with ``forget_rng`` the checkpoint's RNG state is replaced and
    the masks (residual and attention dropout) still match: they derive from the step, not from RNG state."""
    # the replaced RNG file no longer matches its SHA-256: verify sizes only (checkpoint.verify=size)
    extra = ["model.attention_dropout=0.1", "checkpoint.verify=size"] if forget_rng else []
    full = Trainer(_config(tmp_path / "full", "train.steps=20", *extra)).fit()
    reference_trainer = Trainer(_config(tmp_path / "full", "train.steps=20", *extra))
    assert reference_trainer.resume() and reference_trainer.step == 20
    reference = _parameters(reference_trainer)

    Trainer(_config(tmp_path / "split", "train.steps=20", "checkpoint.every=10", *extra)).fit()
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_00000020")  # pretend the run stopped at step 10
    (tmp_path / "split" / "checkpoints" / "latest").write_text("step_00000010\n")
    if forget_rng:  # the saved generator state replaced by another one, of the same size
        rng_file = tmp_path / "split" / "checkpoints" / "step_00000010" / "rng" / "rank_00000.pt"
        torch.save({"torch": torch.Generator().manual_seed(12345).get_state()}, rng_file)
    resumed = Trainer(_config(tmp_path / "split", "train.steps=20", *extra))
    second_half = resumed.fit()
    assert resumed.step == 20
    assert second_half["losses"] == full["losses"][10:]  # exact equality, not a tolerance
    for name, value in _parameters(resumed).items():
        assert torch.equal(value, reference[name]), name


def test_latest_points_at_newest_and_retention_keeps_k(tmp_path):
    Trainer(_config(tmp_path, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=2")).fit()
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000008"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000006", "step_00000008"]


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    trainer = Trainer(_config(tmp_path, "train.steps=2"))
    trainer.fit()
    root = tmp_path / "checkpoints"
    before = {p.name: p.stat().st_size for p in (root / "step_00000002").rglob("*")}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("torch.distributed.checkpoint.save", crash)
    trainer.step = 4
    with pytest.raises(CheckpointError, match=r"disk full; the previous checkpoint \(step 2\) is intact"):
        trainer.save()
    assert not list(root.glob(".tmp-*"))
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert {p.name: p.stat().st_size for p in (root / "step_00000002").rglob("*")} == before
    assert not (root / "step_00000004").exists()
    monkeypatch.undo()
    resumed = Trainer(_config(tmp_path, "train.steps=3"))
    resumed.fit()
    assert resumed.step == 3


def test_truncated_checkpoint_names_the_file(tmp_path):
    Trainer(_config(tmp_path, "train.steps=2")).fit()
    step_dir = tmp_path / "checkpoints" / "step_00000002"
    shard = max((p for p in step_dir.glob("*.distcp")), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        Trainer(_config(tmp_path, "train.steps=4")).fit()
    assert step_dir.is_dir()  # no intact checkpoint to fall back to: nothing is moved, the run does not start over


def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys):
    """A truncated newest checkpoint is moved aside with one warning line and the run resumes from the one before,
    ending where the undisturbed run ended, bit for bit."""
    reference = Trainer(_config(tmp_path, "train.steps=4", "checkpoint.every=2"))
    reference.fit()
    root = tmp_path / "checkpoints"
    shard = max((p for p in (root / "step_00000004").glob("*.distcp")), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    resumed = Trainer(_config(tmp_path, "train.steps=4", "checkpoint.every=2"))
    resumed.fit()
    warnings = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and "step_00000004" in warnings[0] and "truncated" in warnings[0], warnings
    assert (root / "damaged-step_00000004" / shard.name).stat().st_size == 100  # moved aside, not deleted
    assert (root / "latest").read_text().strip() == "step_00000004"  # the new step 4
    for name, value in _parameters(resumed).items():
        assert torch.equal(value, _parameters(reference)[name]), name


def test_corrupt_meta_and_missing_directory_are_reported(tmp_path):
    Trainer(_config(tmp_path, "train.steps=2")).fit()
    root = tmp_path / "checkpoints"
    (root / "step_00000002" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        Trainer(_config(tmp_path, "train.steps=4")).fit()
    shutil.rmtree(root / "step_00000002")
    with pytest.raises(CheckpointError, match="names 'step_00000002'"):
        Trainer(_config(tmp_path, "train.steps=4")).fit()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    Trainer(_config(tmp_path, "train.steps=2")).fit()
    with pytest.raises(CheckpointError, match=r"another model:\n.*shape \[.*64\]"):
        Trainer(_config(tmp_path, "train.steps=4", "model.d_model=64")).fit()


def test_meta_records_config_sampler_and_file_sizes(tmp_path):
    Trainer(_config(tmp_path, "train.steps=2")).fit()
    meta = json.loads((tmp_path / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["config"]["model"]["d_model"] == 32
    assert meta["sampler"]["consumed_samples"] == 8
    assert all(size > 0 for size in meta["files"].values())
    assert Checkpointer.read_meta(tmp_path / "checkpoints" / "step_00000002")["step"] == 2


def test_export_writes_one_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    from xscale.commands.export import export_safetensors
    from xscale.commands.export import main as export_main

    trainer = Trainer(_config(tmp_path, "train.steps=2"))
    trainer.fit()
    path = export_safetensors(tmp_path / "checkpoints", tmp_path / "model.safetensors")
    tensors = load_file(str(path))
    for name, value in trainer.model.model.state_dict().items():
        if name == "output.weight":  # tied to the embedding: stored once
            continue
        assert torch.equal(tensors[name], value), name
    assert export_main([str(tmp_path / "checkpoints"), str(tmp_path / "positional.safetensors")]) == 0
    assert export_main([str(tmp_path / "checkpoints"), "-o", str(tmp_path / "option.safetensors")]) == 0
    assert load_file(str(tmp_path / "positional.safetensors")).keys() == tensors.keys()
    assert (tmp_path / "option.safetensors").is_file()
    with pytest.raises(SystemExit):
        export_main([str(tmp_path / "checkpoints")])  # no output path: a usage error


def test_async_save_completes_and_resumes(tmp_path):
    Trainer(_config(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.async_save=true")).fit()
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert (root / "step_00000002" / "meta.json").is_file()
    resumed = Trainer(_config(tmp_path, "train.steps=5"))
    resumed.fit()
    assert resumed.step == 5


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones(tmp_path):
    """With dropout: the same masks, and nothing compiled after the first step although every step changes the
    masks' key."""
    from torch._dynamo.utils import counters

    eager = Trainer(_config(tmp_path / "eager", "train.steps=3")).fit()["losses"]
    compiled_trainer = Trainer(_config(tmp_path / "compiled", "train.steps=3", "train.compile=true"))
    assert all(hasattr(block, "_compiled_call_impl") and block._compiled_call_impl is not None
               for block in compiled_trainer.model.model.stack.layers.values())
    compiled = [compiled_trainer.train_step()["train/loss"]]
    graphs = counters["stats"]["unique_graphs"]
    compiled += [compiled_trainer.train_step()["train/loss"] for _ in range(2)]
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    assert compiled == pytest.approx(eager, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    ["model.moe.num_experts=4", "model.moe.router=switch", "model.moe.top_k=1", "model.moe.aux_loss_coef=0.5",
     "model.moe.z_loss_coef=0.1"],
    ["model.attention.kind=adaptive_span", "model.attention.options.span_loss=0.5"],
    ["model.stack=act", "model.share_layers=true", "model.stack.options.ponder_cost=0.5"],
], ids=["moe", "adaptive-span", "act"])
def test_compiled_blocks_keep_the_auxiliary_losses(tmp_path, model):
    """The auxiliary losses reach the gradients in compiled blocks too (they were dropped: AOTAutograd replayed a
    view of the attached output outside the graph); the gradient norm shows it, the loss barely would."""
    def run(name, *extra):
        trainer = Trainer(_config(tmp_path / name, "model.dropout=0.0", *model, *extra))
        return [trainer.train_step() for _ in range(2)]

    eager, compiled = run("eager"), run("compiled", "train.compile=true")
    for key in ("train/loss", "train/grad_norm"):
        assert [step[key] for step in compiled] == pytest.approx([step[key] for step in eager], rel=1e-5), key


def test_a_rollback_keeps_every_later_checkpoint_and_retention_keeps_the_new_ones(tmp_path):
    """Resuming at step 2 of a run that reached step 6 (the fix after a loss spike) moves steps 4 and 6 aside
    into abandoned-*/ instead of letting retention delete the new checkpoints; lineage is in meta.json."""
    Trainer(_config(tmp_path, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3")).fit()
    root = tmp_path / "checkpoints"
    originals = {name: (root / name / "meta.json").read_text() for name in ("step_00000004", "step_00000006")}
    rollback = _config(tmp_path, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
                       f"checkpoint.resume={root / 'step_00000002'}")
    Trainer(rollback).fit()
    (abandoned,) = root.glob("abandoned-*")
    assert {name: (abandoned / name / "meta.json").read_text() for name in originals} == originals
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert json.loads((root / "step_00000004" / "meta.json").read_text())["parent"] == str(root / "step_00000002")


DIVERGING = ["train.lr=1e4", "train.grad_clip=0", "train.warmup_steps=0", "train.steps=8", "checkpoint.every=1"]


def test_a_nonfinite_step_stops_the_run_before_it_is_applied_or_checkpointed(tmp_path):
    """lr=1e4 without clipping: the loss is NaN within a few steps; the run stops with the reason, and every
    checkpoint it wrote holds finite weights (the NaN update was never applied)."""
    from xscale.train.trainer import NonFiniteTraining

    trainer = Trainer(_config(tmp_path, *DIVERGING))
    with pytest.raises(NonFiniteTraining, match="is not finite .*train.on_nonfinite=skip"):
        trainer.fit()
    assert all(torch.isfinite(p).all() for p in trainer.model.model.parameters())
    latest = Checkpointer(tmp_path / "checkpoints").latest()
    assert latest is not None and Checkpointer.read_meta(latest)["step"] == trainer.step


def test_nonfinite_steps_are_skipped_until_too_many_in_a_row(tmp_path):
    from xscale.train.trainer import NonFiniteTraining

    trainer = Trainer(_config(tmp_path, *DIVERGING, "train.on_nonfinite=skip", "train.max_skipped=2"))
    with pytest.raises(NonFiniteTraining, match=r"3 non-finite steps in a row \(train.max_skipped=2\)"):
        trainer.fit()
    assert trainer.skipped_steps == 3
    assert all(torch.isfinite(p).all() for p in trainer.model.model.parameters())


def test_checkpoint_every_minus_one_writes_none_but_a_stop_still_saves(tmp_path, monkeypatch):
    """checkpoint.every=-1 (benchmarks, throwaway runs): no checkpoint on schedule or at the end; a preemption or
    Ctrl-C (the stop vote) still saves the step it stopped at."""
    Trainer(_config(tmp_path / "never", "train.steps=4", "checkpoint.every=-1")).fit()
    assert not list((tmp_path / "never" / "checkpoints").glob("step_*"))
    stopped = Trainer(_config(tmp_path / "stopped", "train.steps=8", "checkpoint.every=-1"))
    votes = iter([False, False, True])
    monkeypatch.setattr(stopped.preemption, "should_stop", lambda: next(votes, True))
    assert stopped.fit()["step"] == 3
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
