"""In-memory snapshots (``checkpoint.memory_every``): each rank's state in host memory that outlives its process,
and a replica of it on a peer rank, so that a lost worker resumes from its last step instead of the last checkpoint.

Every N steps each rank writes its own part of the state (model and optimizer tensors as it holds them, the RNG
state, its per-rank tensors and the checkpoint's meta) to ``/dev/shm/xscale-<run>/rank_R.snapshot`` (tmpfs: it
survives torchrun killing and restarting the workers on the node), through a temporary file renamed into place,
behind an integrity record (config, step, world layout, size, SHA-256 of the payload). It sends the same bytes to
its peer, rank ``(R + local_world_size) % world`` (a rank on another node; on one node the next rank), which writes
them as ``replica_of_rank_R.snapshot`` in its own /dev/shm: a node's memory lost still leaves one copy.

On ``checkpoint.resume=auto`` the ranks agree (one all_gather) on the newest step that every rank has intact, from
its own file or its peer's replica, of the same config and layout; a rank whose own copy is gone or damaged gets
the replica over the process group. Disk checkpoints stay the source of truth: a snapshot is used only when it is
newer than the newest disk checkpoint, and the files are removed when the run ends cleanly.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from xscale.checkpoint.checkpointer import Checkpointer, step_of
from xscale.checkpoint.sizes import readable_size
from xscale.config.schema import Config

MAGIC = b"xscale memory snapshot 1\n"  # the last bytes of a snapshot file
LENGTH = struct.Struct(">Q")  # the integrity record's length, before MAGIC
SHM = Path("/dev/shm")
Leaf = tuple[list[Any], Any]  # a path of keys into the state and the value there


def peer_of(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank that holds ``rank``'s replica: the same local rank on the next node, or on one node the next rank."""
    shift = local_world_size if world_size > local_world_size else 1
    return (rank + shift) % world_size


def source_of(holder: int, world_size: int, local_world_size: int) -> int:
    """The rank whose replica ``holder`` keeps (the inverse of :func:`peer_of`)."""
    shift = local_world_size if world_size > local_world_size else 1
    return (holder - shift) % world_size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def plain_leaves(state: Any, path: list[Any] | None = None) -> list[Leaf]:
    """Every leaf of a (nested) state dict with its path: tensors as this rank's CPU tensors (a DTensor's local
    shard; a view copied, so that torch.save does not write its whole storage), anything else as it is."""
    path = path or []
    if isinstance(state, dict):
        return [leaf for key, value in state.items() for leaf in plain_leaves(value, [*path, key])]
    if isinstance(state, list):
        return [leaf for index, value in enumerate(state) for leaf in plain_leaves(value, [*path, index])]
    if isinstance(state, torch.Tensor):
        local = _local(state).detach().cpu()
        whole = local.is_contiguous() and local.untyped_storage().nbytes() == local.numel() * local.element_size()
        return [(path, local if whole else local.clone())]
    return [(path, state)]


def fill_state(state: Any, leaves: list[Leaf]) -> None:
    """Put ``leaves`` (:func:`plain_leaves` of a state of the same layout) back into ``state``: tensors copied in
    place (into a DTensor's local shard), other values replaced."""
    for path, value in leaves:
        container = state
        for key in path[:-1]:
            container = container[key]
        current = container[path[-1]]
        if isinstance(current, torch.Tensor):
            local = _local(current)
            if not isinstance(value, torch.Tensor) or local.shape != value.shape:
                raise SnapshotError(f"{'/'.join(map(str, path))}: the snapshot holds "
                                    f"{getattr(value, 'shape', type(value).__name__)}, this rank {tuple(local.shape)}")
            local.copy_(value)
        else:
            container[path[-1]] = value


class SnapshotError(RuntimeError):
    """A snapshot file that cannot be used; the message says why in one line."""


@dataclass(frozen=True)
class Found:
    """What one rank found in one snapshot file: its step, or why it cannot be used."""

    step: int | None
    problem: str | None = None


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed to resume: the snapshot step (None: none, with ``why``), the ranks that get it from
    their peer's replica, and whether this rank holds a replica one of them needs."""

    step: int | None
    from_peer: list[int]
    why: str
    holds_needed: bool = False


class _HashingWriter:
    """The file torch.save writes into, hashing the bytes on their way (one pass over them)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.sha256, self.size = handle, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()


def write_snapshot(handle: BinaryIO, record: dict[str, Any], payload: dict[str, Any]) -> None:
    """A snapshot: the payload (torch.save), then its integrity record (``record`` with the payload's size and
    SHA-256) as JSON, the record's length and :data:`MAGIC`; written in one pass, the record last."""
    writer = _HashingWriter(handle)
    torch.save(payload, writer)
    trailer = json.dumps({**record, "bytes": writer.size, "sha256": writer.sha256.hexdigest()}, sort_keys=True).encode()
    handle.write(trailer + LENGTH.pack(len(trailer)) + MAGIC)


def encode(record: dict[str, Any], payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    write_snapshot(buffer, record, payload)
    return buffer.getvalue()


def decode_record(blob: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The integrity record and payload of a snapshot's bytes, after checking the payload's size and checksum."""
    view = memoryview(blob)
    end = len(view) - len(MAGIC) - LENGTH.size
    if end < 0 or bytes(view[end + LENGTH.size:]) != MAGIC:
        raise SnapshotError("no integrity record at its end (truncated, or not an xscale memory snapshot)")
    (length,) = LENGTH.unpack(view[end:end + LENGTH.size])
    try:
        record = json.loads(bytes(view[end - length:end])) if length <= end else None
        size, digest = int(record["bytes"]), record["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise SnapshotError(f"unreadable integrity record ({error})") from error
    data = view[:end - length]
    if len(data) != size:
        raise SnapshotError(f"truncated: {len(data)} of {size} bytes")
    if hashlib.sha256(data).hexdigest() != digest:
        raise SnapshotError("its SHA-256 does not match its integrity record")
    return record, data


def decode_payload(data: bytes | memoryview) -> dict[str, Any]:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise SnapshotError(f"its payload does not load with weights_only=True ({error})") from error


def _transport_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _exchange(outgoing: Path | None, send_to: int | None, receive_from: int | None) -> memoryview | None:
    """Send file ``outgoing`` (mapped, not copied; None: an empty message) to ``send_to`` and receive one from
    ``receive_from`` (None when it was empty), over the default process group: the size first, then the bytes."""
    device = _transport_device()
    data = None
    if send_to is not None and outgoing is not None:
        with open(outgoing, "rb") as handle:
            data = torch.frombuffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    requests, size = [], torch.zeros(1, dtype=torch.int64, device=device)
    if send_to is not None:
        sent = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
        requests.append(dist.isend(sent, send_to))
    if receive_from is not None:
        requests.append(dist.irecv(size, receive_from))
    for request in requests:
        request.wait()
    requests, received = [], None
    if data is not None:
        requests.append(dist.isend(data.to(device), send_to))
    if receive_from is not None and size.item() > 0:
        received = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        requests.append(dist.irecv(received, receive_from))
    for request in requests:
        request.wait()
    return None if received is None else memoryview(received.cpu().numpy())


def _dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys (config.train.lr) -> values."""
    if not isinstance(value, dict):
        return {prefix: value}
    return {key: leaf for name, inner in value.items()
            for key, leaf in _dotted(inner, f"{prefix}.{name}" if prefix else str(name)).items()}


def snapshot_key(run: Path) -> str:
    """The name of a run's snapshot folder: its checkpoint directory, hashed."""
    return hashlib.sha256(str(Path(run).resolve()).encode()).hexdigest()[:16]


def snapshot_identity(config: Config, layout: str) -> dict[str, Any]:
    """What a snapshot must share with the run that resumes it: the whole config (but checkpoint.resume) and the
    layout; any change (an override, another world) makes the run resume from disk."""
    settings = config.to_dict()
    settings["checkpoint"].pop("resume", None)
    return {"config": settings, "layout": layout}


def open_snapshots(config: Config, layout: str, run: Path, rank: int, world_size: int, local_world_size: int,
                   root: Path = SHM) -> MemorySnapshots | None:
    """The run's snapshots when ``checkpoint.memory_every`` asks for them and ``root`` (/dev/shm) exists; where it
    does not, one line says so and the run keeps disk checkpoints only."""
    if not config.checkpoint.memory_every:
        return None
    lacking = [rank] if not root.is_dir() else []
    if dist.is_available() and dist.is_initialized() and world_size > 1:  # every rank keeps snapshots, or none
        everyone: list[list[int]] = [[] for _ in range(world_size)]
        dist.all_gather_object(everyone, lacking)
        lacking = [lacked for part in everyone for lacked in part]
    if lacking:
        if rank == 0:
            where = "here" if world_size == 1 else f"on rank(s) {', '.join(map(str, lacking[:8]))}"
            print(f"xscale: checkpoint.memory_every={config.checkpoint.memory_every}: {root} does not exist {where}, "
                  "so no memory snapshots are kept; a restart resumes from the disk checkpoints", flush=True)
        return None
    return MemorySnapshots(run, snapshot_identity(config, layout), rank, world_size, local_world_size, root)


def newer_than_disk(agreement: Agreement, checkpointer: Checkpointer) -> tuple[bool, str]:
    """Whether the agreed snapshot is newer than the newest intact disk checkpoint (the one ``latest`` names, or when
    the snapshot is not newer than that, the newest that verifies: ``latest`` may be damaged), and one line why."""
    if agreement.step is None:
        return False, agreement.why
    disk = checkpointer.latest_step()
    if disk is not None and agreement.step <= disk:
        intact = checkpointer.newest_intact()
        disk = step_of(intact) if intact is not None else None
    if disk is not None and agreement.step <= disk:
        return False, f"the memory snapshot of step {agreement.step} is not newer than the disk checkpoint of step {disk}"
    newer = f"newer than the disk checkpoint of step {disk}" if disk is not None else "no disk checkpoint yet"
    return True, f"the memory snapshot of step {agreement.step} ({newer}; {agreement.why})"


class MemorySnapshots:
    """This rank's snapshot files and its peer's replica. ``run``: the checkpoint directory (names the folder);
    ``identity``: what must match for a snapshot to be resumed (the config, the layout)."""

    def __init__(self, run: Path, identity: dict[str, Any], rank: int, world_size: int, local_world_size: int,
                 root: Path = SHM) -> None:
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self.directory = root / f"xscale-{snapshot_key(run)}"
        self.peer = peer_of(rank, world_size, local_world_size) if world_size > 1 else None
        self.source = source_of(rank, world_size, local_world_size) if world_size > 1 else None
        self.warned = False  # a failed write was reported

    def own_file(self) -> Path:
        return self.directory / f"rank_{self.rank:05d}.snapshot"

    def replica_file(self) -> Path:
        """The replica this rank keeps of its source rank's snapshot."""
        return self.directory / f"replica_of_rank_{self.source:05d}.snapshot"

    def _record(self, step: int, rank: int) -> dict[str, Any]:
        return {"identity": self.identity, "step": step, "rank": rank, "world_size": self.world_size,
                "local_world_size": self.local_world_size}

    # ------------------------------------------------------------------ take
    def take(self, step: int, payload: dict[str, Any]) -> int:
        """Write this rank's snapshot of ``step`` and its peer's replica (collective); returns the bytes written."""
        record = self._record(step, self.rank)
        written = self._write(self.own_file(), step, lambda handle: write_snapshot(handle, record, payload))
        if self.peer is None:
            return written
        # Sent even when this rank's write failed (an empty message): the peer waits for it.
        replica = _exchange(self.own_file() if written else None, self.peer, self.source)
        if replica is None:
            return written
        return written + self._write(self.replica_file(), step, lambda handle: handle.write(replica))

    def _write(self, path: Path, step: int, fill: Callable[[BinaryIO], Any]) -> int:
        """Write ``path`` atomically with ``fill``; returns its size. A full or missing /dev/shm costs this copy, not
        the run: one line (the first time), the partial file removed, and the previous copy left for its own step."""
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                fill(handle)
            os.replace(temporary, path)
            return path.stat().st_size
        except OSError as error:
            temporary.unlink(missing_ok=True)
            if not self.warned:
                self.warned = True
                free = shutil.disk_usage(self.directory.parent).free if self.directory.parent.is_dir() else 0
                print(f"xscale: warning: rank {self.rank} could not write its memory snapshot of step {step} to {path} "
                      f"({error.strerror or error}; {readable_size(free)} free there): a restart resumes an older "
                      "snapshot or the disk checkpoint (said once; make /dev/shm larger, e.g. docker --shm-size)",
                      flush=True)
            return 0

    def _files(self) -> list[Path]:
        return [self.own_file(), *([self.replica_file()] if self.source is not None else [])]

    def _remove_partial(self) -> None:
        """Remove the temporary files of this rank's snapshots that a killed writer left behind."""
        for path in self._files():
            for partial in self.directory.glob(f".{path.name}.tmp-*"):
                partial.unlink(missing_ok=True)

    def remove(self) -> None:
        """Remove this rank's files (the run ended cleanly: its last disk checkpoint holds everything)."""
        self._remove_partial()
        for path in self._files():
            path.unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass  # another rank's files are still there, or it is gone

    # ------------------------------------------------------------------ resume
    def _inspect(self, path: Path, rank: int) -> Found:
        """The step of snapshot ``path`` of rank ``rank``, or why it cannot be resumed."""
        if not path.is_file():
            return Found(None, "missing")
        try:
            record, _ = decode_record(path.read_bytes())
        except (SnapshotError, OSError) as error:
            return Found(None, str(error))
        expected = self._record(int(record.get("step", -1)), rank)
        if record.get("identity") != expected["identity"]:
            saved, wanted = _dotted(record.get("identity")), _dotted(expected["identity"])
            differing = sorted(key for key in set(saved) | set(wanted) if saved.get(key) != wanted.get(key))
            return Found(None, f"made by another config or layout ({', '.join(differing[:3])} differs)")
        if (record.get("world_size"), record.get("local_world_size"), record.get("rank")) != (
                self.world_size, self.local_world_size, rank):
            return Found(None, f"made by rank {record.get('rank')} of a world of {record.get('world_size')} "
                               f"({record.get('local_world_size')} per node); this is rank {rank} of "
                               f"{self.world_size} ({self.local_world_size} per node)")
        return Found(int(record["step"]))

    def agree(self) -> Agreement:
        """Collective. The newest snapshot step every rank has intact, from its own file or the replica its peer
        holds, and which ranks need the replica; no step (and why, or nothing when no rank has any file) else."""
        self._remove_partial()  # no rank writes while they agree
        own = self._inspect(self.own_file(), self.rank)
        held = self._inspect(self.replica_file(), self.source) if self.source is not None else Found(None, "none")
        everyone = [(own, held)]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, (own, held))
        owns = [found[0] for found in everyone]
        replicas = {peer_of(holder, self.world_size, self.local_world_size): found[1]
                    for holder, found in enumerate(everyone)} if self.world_size > 1 else {}
        available = [{found.step for found in (owns[rank], replicas.get(rank)) if found and found.step is not None}
                     for rank in range(self.world_size)]
        common = set.intersection(*available)
        if not common:
            nothing = all(found.problem == "missing" for found in [*owns, *replicas.values()])
            return Agreement(None, [], "" if nothing else f"no usable memory snapshot "
                                                           f"({self._why_not(available, owns, replicas)})")
        step = max(common)
        from_peer = [rank for rank in range(self.world_size) if owns[rank].step != step]
        peers = (f", {len(from_peer)} rank(s) from a peer's replica ({', '.join(map(str, from_peer))})"
                 if from_peer else "")
        return Agreement(step, from_peer, f"intact on all {self.world_size} rank(s){peers}",
                         holds_needed=self.source in from_peer and replicas[self.source].step == step)

    def fetch(self, agreement: Agreement) -> dict[str, Any]:
        """Collective. This rank's payload of the agreed step: its own file, or its replica sent by the rank that
        holds it (which sends while the others receive)."""
        step, from_peer = agreement.step, agreement.from_peer
        blob = _exchange(self.replica_file() if agreement.holds_needed else None,
                         self.source if agreement.holds_needed else None,
                         self.peer if self.rank in from_peer else None) if from_peer else None
        if self.rank not in from_peer:
            blob = self.own_file().read_bytes()
        if blob is None:
            raise SnapshotError(f"rank {self.rank}: its snapshot of step {step} did not arrive from rank {self.peer}")
        record, data = decode_record(blob)
        if record["step"] != step:
            raise SnapshotError(f"{self.directory}: rank {self.rank}'s snapshot changed while it was being resumed")
        return decode_payload(data)

    def _why_not(self, available: list[set[int]], owns: list[Found], replicas: dict[int, Found]) -> str:
        """Why no step is intact on every rank: the first rank without one, or the steps each rank has."""
        for rank, steps in enumerate(available):
            if not steps:
                held = replicas.get(rank)
                where = (f"; its replica on rank {peer_of(rank, self.world_size, self.local_world_size)}: "
                         f"{held.problem}" if held else "")
                return f"rank {rank}'s: {owns[rank].problem}{where}"
        return "the ranks hold different steps: " + ", ".join(f"rank {rank} {sorted(steps)}"
                                                              for rank, steps in enumerate(available))
