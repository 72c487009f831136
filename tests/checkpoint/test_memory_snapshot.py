"""In-memory snapshots (checkpoint.memory_every): a run that dies after its last disk checkpoint resumes from the
step in memory, bit for bit; a damaged, stale or foreign snapshot is passed over with one line; a rank whose own
copy is gone gets it from the replica its peer holds."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from xscale.checkpoint import memory_snapshot
from xscale.checkpoint.memory_snapshot import (
    MemorySnapshots,
    SnapshotError,
    decode_payload,
    decode_record,
    encode,
    open_snapshots,
    peer_of,
    source_of,
)
from xscale.config.load import load_config
from xscale.launcher.local import start_local
from xscale.train.trainer import Trainer

TINY = [
    "model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.dropout=0.1", "train.global_batch_size=4", "train.seq_len=16", "train.warmup_steps=3",
    "train.log_every=100", "train.tensorboard=false", "train.plot=false", "train.progress=false",
    "train.peak_flops=1e12", "data.dataset=copy", "data.num_samples=64", "data.eval_fraction=0.0",
    "train.steps=8", "checkpoint.every=3",
]


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads contend and a tiny run takes several times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(directory: Path, *extra: str):
    return load_config(None, [*TINY, f"train.output_dir={directory}", *extra])


def _crash_before(trainer: Trainer, step: int) -> Trainer:
    """The trainer's process dies (an exception here) just before step ``step``."""
    train_step = trainer.train_step

    def crashing() -> dict[str, float]:
        if trainer.step + 1 == step:
            raise RuntimeError("worker lost")
        return train_step()

    trainer.train_step = crashing
    return trainer


def _crashed_run(directory: Path, step: int, *extra: str) -> Trainer:
    trainer = _crash_before(Trainer(_config(directory, "checkpoint.memory_every=1", *extra)), step)
    with pytest.raises(RuntimeError, match="worker lost"):
        trainer.fit()
    return trainer


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {f"model/{name}": p.detach().clone() for name, p in trainer.model.model.named_parameters()}
    for index, values in trainer.optimizer.state_dict()["state"].items():
        state.update({f"optimizer/{index}/{key}": value.clone() for key, value in values.items()})
    return state


def test_the_peer_is_the_same_local_rank_on_the_next_node_or_the_next_rank_on_one_node():
    assert [peer_of(rank, 4, 2) for rank in range(4)] == [2, 3, 0, 1]
    assert [peer_of(rank, 2, 2) for rank in range(2)] == [1, 0]
    assert [peer_of(rank, 3, 3) for rank in range(3)] == [1, 2, 0]
    assert all(source_of(peer_of(rank, 6, 2), 6, 2) == rank for rank in range(6))


def test_a_run_killed_after_its_last_checkpoint_resumes_from_memory_bit_for_bit(tmp_path, capsys, one_thread):
    full = Trainer(_config(tmp_path / "full"))
    losses = full.fit()["losses"]
    crashed = _crashed_run(tmp_path / "crashed", 6)  # disk checkpoint at step 3, memory at step 5
    assert crashed.snapshots.own_file().is_file()
    (crashed.snapshots.directory / ".rank_00000.snapshot.tmp-99999").write_bytes(b"a write cut short by a kill")
    resumed = Trainer(_config(tmp_path / "crashed", "checkpoint.memory_every=1"))
    assert resumed.fit()["losses"] == losses[5:]  # exact equality
    assert "resumed from the memory snapshot of step 5 (newer than the disk checkpoint of step 3" in capsys.readouterr().out
    reference, state = _state(full), _state(resumed)
    assert reference.keys() == state.keys() and any(key.startswith("optimizer/") for key in state)
    assert all(torch.equal(state[key], reference[key]) for key in reference), "not bit-identical"
    assert not resumed.snapshots.own_file().exists() and not resumed.snapshots.directory.exists()  # clean end


@pytest.mark.parametrize("damage", ["flip", "truncate", "config"])
def test_a_damaged_or_foreign_snapshot_is_passed_over_with_one_line(tmp_path, capsys, one_thread, damage):
    snapshot = _crashed_run(tmp_path, 6).snapshots.own_file()
    blob = bytearray(snapshot.read_bytes())
    if damage == "flip":
        blob[len(blob) // 3] ^= 0xFF  # in the payload
        snapshot.write_bytes(bytes(blob))
    elif damage == "truncate":
        snapshot.write_bytes(bytes(blob[: len(blob) // 2]))
    capsys.readouterr()
    resumed = Trainer(_config(tmp_path, "checkpoint.memory_every=1", *(["train.lr=2e-3"] if damage == "config" else [])))
    assert resumed.resume() and resumed.step == 3
    out = capsys.readouterr().out
    reason = {"flip": "its SHA-256 does not match", "truncate": "no integrity record at its end (truncated", "config": "made by another config or layout (config.train.lr differs)"}[damage]
    assert f"xscale: no usable memory snapshot (rank 0's: {reason}" in out and "; resuming from disk" in out
    assert "resumed from" in out and "step_00000003 at step 3" in out
    resumed.snapshots.remove()


def test_a_snapshot_not_newer_than_the_disk_checkpoint_is_passed_over_with_one_line(tmp_path, capsys, one_thread):
    _crashed_run(tmp_path, 4)  # disk and memory both at step 3
    resumed = Trainer(_config(tmp_path, "checkpoint.memory_every=1"))
    assert resumed.resume() and resumed.step == 3
    out = capsys.readouterr().out
    assert "xscale: the memory snapshot of step 3 is not newer than the disk checkpoint of step 3; resuming from disk" in out
    assert "step_00000003 at step 3" in out
    resumed.snapshots.remove()


def test_without_dev_shm_one_line_says_there_are_no_memory_snapshots(tmp_path, capsys):
    config = _config(tmp_path, "checkpoint.memory_every=2")
    assert open_snapshots(config, "world 1", tmp_path, 0, 1, 1, root=tmp_path / "no-shm") is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "does not exist here, so no memory snapshots are kept" in out[0]
    assert open_snapshots(_config(tmp_path), "world 1", tmp_path, 0, 1, 1) is None  # off by default


def test_a_full_dev_shm_costs_the_snapshot_not_the_run(tmp_path, capsys, monkeypatch):
    snapshots = MemorySnapshots(tmp_path / "run", {"config": "c"}, 0, 1, 1, root=tmp_path)
    snapshots.take(1, {"x": torch.ones(2)})

    def full(handle, record, payload):
        handle.write(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memory_snapshot, "write_snapshot", full)
    assert snapshots.take(2, {"x": torch.ones(2)}) == 0 and snapshots.take(3, {"x": torch.ones(2)}) == 0
    monkeypatch.undo()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "could not write its memory snapshot of step 2" in out[0] and "No space left" in out[0]
    assert snapshots.agree().step == 1  # the previous snapshot is left for its own step
    assert sorted(p.name for p in snapshots.directory.iterdir()) == ["rank_00000.snapshot"]


def test_a_snapshot_of_another_layout_is_not_resumed(tmp_path):
    """An elastic restart (another world, another layout) resumes from disk: DCP reshards, a snapshot cannot."""
    MemorySnapshots(tmp_path / "run", {"config": "c", "layout": "world 2: dp_shard=2"}, 0, 1, 1,
                    root=tmp_path).take(4, {"x": torch.ones(2)})
    agreement = MemorySnapshots(tmp_path / "run", {"config": "c", "layout": "world 1: single process"}, 0, 1, 1,
                                root=tmp_path).agree()
    assert agreement.step is None and "made by another config or layout (layout differs)" in agreement.why


def test_the_integrity_record_refuses_a_foreign_file_and_a_payload_that_does_not_load_safely():
    with pytest.raises(SnapshotError, match="no integrity record at its end"):
        decode_record(b"anything")
    record, data = decode_record(encode({"step": 1}, {"x": torch.arange(3)}))
    assert record["step"] == 1 and torch.equal(decode_payload(data)["x"], torch.arange(3))
    with pytest.raises(SnapshotError, match="weights_only"):
        decode_payload(b"not a torch file")


# ---------------------------------------------------------------------- two ranks: the peer's replica


def _own_shard_lost(rank: int, root: str, lost: int) -> None:
    snapshots = MemorySnapshots(Path(root) / "run", {"config": "c"}, rank, 2, 2, root=Path(root))
    for step in (1, 2):
        snapshots.take(step, {"state": [[["w"], torch.full((3,), float(10 * rank + step))]]})
    dist.barrier()
    if rank == lost:
        snapshots.own_file().unlink()
    dist.barrier()
    agreement = snapshots.agree()
    assert (agreement.step, agreement.from_peer) == (2, [lost]), agreement
    assert agreement.why == f"intact on all 2 rank(s), 1 rank(s) from a peer's replica ({lost})"
    payload = snapshots.fetch(agreement)
    assert torch.equal(payload["state"][0][1], torch.full((3,), float(10 * rank + 2)))
    dist.barrier()
    if rank == 1 - lost:  # both copies of the lost rank gone: no step is whole, and the line names why
        snapshots.replica_file().unlink()
    dist.barrier()
    agreement = snapshots.agree()
    assert agreement.step is None and f"rank {lost}'s: missing; its replica on rank {1 - lost}: missing" in agreement.why


def _run(rank: int, store: str, check, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        check(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lost", [0, 1])
def test_a_rank_whose_own_snapshot_is_gone_gets_it_from_its_peer_s_replica(tmp_path, lost):
    with tempfile.TemporaryDirectory(prefix="xscale-snapshots-") as scratch:
        start_local(_run, 2, (os.path.join(scratch, "store"), _own_shard_lost, (str(tmp_path), lost)))
