"""Damaged, crafted and unwritable checkpoints: refused or reported in one line, never loaded, never a lost run.

Every case starts from one small checkpoint (a module fixture) copied into the test's folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xscale.checkpoint.checkpointer as checkpoint_module
from xscale.checkpoint.checkpointer import Checkpointer, CheckpointError
from xscale.checkpoint.integrity import sealed_meta
from xscale.commands.export import export_safetensors
from xscale.config.load import load_config
from xscale.train.trainer import Trainer

TINY = [
    "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
    "train.global_batch_size=4", "train.seq_len=16", "train.warmup_steps=1", "train.log_every=100",
    "train.tensorboard=false", "train.plot=false", "train.progress=false",
    "data.dataset=copy", "data.num_samples=32", "data.eval_fraction=0.0",
]
STEP = "step_00000002"


def _config(output_dir: Path, *extra: str):
    return load_config(None, [*TINY, f"train.output_dir={output_dir}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("trained")
    Trainer(_config(output_dir, "train.steps=2")).fit()
    return output_dir


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run's output folder, free to damage."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _largest_shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _rewrite_meta_for(step_dir: Path, name: str) -> None:
    """Record ``name``'s current size and digest in meta.json and reseal it, as an attacker crafting a whole
    checkpoint would (the checksums guard against damage and edits by hand, not against forgery)."""
    meta_file = step_dir / "meta.json"
    meta = json.loads(meta_file.read_text())
    data = (step_dir / name).read_bytes()
    meta["files"][name] = len(data)
    meta["sha256"][name] = hashlib.sha256(data).hexdigest()
    meta_file.write_text(json.dumps(sealed_meta(meta)))


class _Payload:
    """Unpickling this runs ``Path(marker).touch()``: what a malicious ``.metadata`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_meta_json_records_a_sha256_for_every_file(run):
    meta = json.loads((run / "checkpoints" / STEP / "meta.json").read_text())
    assert set(meta["sha256"]) == set(meta["files"]) and ".metadata" in meta["files"]
    for name, digest in meta["sha256"].items():
        assert hashlib.sha256((run / "checkpoints" / STEP / name).read_bytes()).hexdigest() == digest


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(run):
    shard = _largest_shard(run / "checkpoints" / STEP)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # same size: only digests see it
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match the SHA-256"):
        Trainer(_config(run, "train.steps=3")).fit()
    with pytest.raises(CheckpointError, match="SHA-256"):
        export_safetensors(run / "checkpoints", run / "model.safetensors")
    # verify=size trusts the sizes: the damage goes unseen (what the default protects against)
    Trainer(_config(run, "train.steps=3", "checkpoint.verify=size")).resume()


def test_a_crafted_metadata_pickle_is_refused_without_running_it(run, tmp_path):
    step_dir = run / "checkpoints" / STEP
    marker = tmp_path / "code-ran"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_meta_for(step_dir, ".metadata")  # digests match: the allow-list is what refuses it
    with pytest.raises(CheckpointError, match="not part of DCP checkpoint metadata"):
        Trainer(_config(run, "train.steps=3")).fit()
    with pytest.raises(CheckpointError, match="not part of DCP checkpoint metadata"):
        export_safetensors(step_dir, run / "model.safetensors")
    assert not marker.exists()


def test_damaged_metadata_is_one_clear_line_from_the_command_line(run):
    step_dir = run / "checkpoints" / STEP
    (step_dir / ".metadata").write_bytes(b"\x80\x04garbage that is not a pickle")
    _rewrite_meta_for(step_dir, ".metadata")
    result = subprocess.run([sys.executable, "-m", "xscale", "train", *TINY, f"train.output_dir={run}",
                             "train.steps=3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert ".metadata is not a DCP checkpoint's metadata or is damaged" in result.stderr


def test_a_damaged_shard_under_verify_none_is_a_checkpoint_error_not_a_traceback(run):
    shard = _largest_shard(run / "checkpoints" / STEP)
    shard.write_bytes(b"\0" * shard.stat().st_size)  # DCP raises CheckpointException, a BaseException
    with pytest.raises(CheckpointError, match=rf"could not read checkpoint .*{STEP}: rank 0: "):
        Trainer(_config(run, "train.steps=3", "checkpoint.verify=none")).fit()


def test_too_little_free_space_is_refused_before_writing(run, monkeypatch):
    trainer = Trainer(_config(run, "train.steps=3"))
    assert trainer.resume()
    before = {p.name: p.read_bytes() for p in (run / "checkpoints" / STEP).rglob("*") if p.is_file()}
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 9, 1))
    trainer.step = 3
    with pytest.raises(CheckpointError, match=r"not enough free space to save step 3 in .*: it needs about [0-9.]+ "
                       r"[KM]iB, 1 B are free; .* checkpoint.dir elsewhere \(the previous checkpoint \(step 2\) is intact\)"):
        trainer.save()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == STEP
    assert {p.name: p.read_bytes() for p in (run / "checkpoints" / STEP).rglob("*") if p.is_file()} == before


def test_a_disk_full_while_writing_is_one_line_and_keeps_the_previous_checkpoint(run, monkeypatch):
    trainer = Trainer(_config(run, "train.steps=3"))
    assert trainer.resume()

    def disk_full(state, checkpoint_id, **kwargs):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.dcp, "save", disk_full)
    trainer.step = 3
    with pytest.raises(CheckpointError, match=r"^no space left on device while saving step 3 to .*checkpoints \(about "
                       r"[0-9.]+ [KM]iB needed, [0-9.]+ [KMGT]iB free\); the previous checkpoint \(step 2\) is intact"):
        trainer.save()
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial copy is gone
    monkeypatch.undo()
    assert Checkpointer(run / "checkpoints").latest().name == STEP
    Checkpointer.read_meta(run / "checkpoints" / STEP, verify="full")


@pytest.mark.parametrize("failure", ["torch.save", "dcp"])
def test_a_disk_filled_during_the_save_is_named_as_such(run, monkeypatch, failure):
    """torch.save reports a full disk as ``unexpected pos`` (no errno), DCP wraps the ENOSPC of a rank: both are
    one line saying no space is left, with readable sizes."""
    trainer = Trainer(_config(run, "train.steps=3"))
    assert trainer.resume()
    disk = {"free": 3 << 30}
    real_usage = shutil.disk_usage
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage",
                        lambda path: real_usage(path)._replace(free=disk["free"]))

    def fill_the_disk(*args, **kwargs):
        disk["free"] = 4096  # another job filled it meanwhile
        if failure == "torch.save":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise checkpoint_module.CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left"), "trace")})

    monkeypatch.setattr(checkpoint_module.torch if failure == "torch.save" else checkpoint_module.dcp, "save",
                        fill_the_disk)
    trainer.step = 3
    with pytest.raises(CheckpointError) as error:
        trainer.save()
    message = str(error.value)
    assert "\n" not in message and "unexpected pos" not in message
    assert message.startswith("no space left on device while saving step 3 to "), message
    assert "GiB free); the previous checkpoint (step 2) is intact" in message
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_a_partial_save_left_by_a_crash_is_removed_at_the_next_start(run):
    partial = run / "checkpoints" / ".tmp-step_00000004"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    trainer = Trainer(_config(run, "train.steps=3"))
    assert not partial.exists()
    assert trainer.resume() and trainer.step == 2


def test_a_step_being_replaced_when_the_job_died_is_put_back(run):
    root = run / "checkpoints"
    (root / STEP).rename(root / f".old-{STEP}")  # died between moving the old copy aside and renaming the new
    Checkpointer(root)
    assert (root / STEP / "meta.json").is_file() and not (root / f".old-{STEP}").exists()


def test_rng_files_load_with_weights_only(run):
    rng_file = run / "checkpoints" / STEP / "rng" / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state(), "payload": _Payload(run / "x")}, rng_file)
    _rewrite_meta_for(run / "checkpoints" / STEP, "rng/rank_00000.pt")
    with pytest.raises(CheckpointError, match="rank_00000.pt"):
        Trainer(_config(run, "train.steps=3")).resume()
    assert not (run / "x").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 1.5 MiB tmpfs (room for one tiny checkpoint and a little more), unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}; the monkeypatched "
                    "disk-full tests above still run")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("free_space_checked", [True, False], ids=["refused-before-writing", "enospc-while-writing"])
def test_a_full_tmpfs_is_one_line_and_keeps_the_previous_checkpoint(run, small_disk, monkeypatch, free_space_checked):
    """A real full disk: the save is refused (free-space check) or fails with ENOSPC inside DCP's write; either way
    one CheckpointError line, no partial directory, and the previous checkpoint loads and verifies."""
    trainer = Trainer(_config(run, "train.steps=3", f"checkpoint.dir={small_disk / 'checkpoints'}"))
    trainer.step = 2
    trainer.save()
    trainer.checkpointer.wait()
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * max(free - 4096, 0))  # leave 4 KiB: far less than a checkpoint
    if not free_space_checked:
        space_for = checkpoint_module._space_for
        monkeypatch.setattr(checkpoint_module, "_space_for", lambda directory, state: (space_for(directory, state)[0], 1 << 40))
    trainer.step = 3
    with pytest.raises(CheckpointError) as error:
        trainer.save()
        trainer.checkpointer.wait()
    message = str(error.value)
    assert "\n" not in message
    assert ("not enough free space" in message) if free_space_checked else ("no space left on device" in message)
    assert "the previous checkpoint (step 2) is intact" in message
    assert not list((small_disk / "checkpoints").glob(".tmp-*"))
    latest = Checkpointer(small_disk / "checkpoints").latest()
    assert latest is not None and latest.name == STEP
    Checkpointer.read_meta(latest, verify="full")
